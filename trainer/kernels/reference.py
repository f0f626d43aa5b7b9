"""Dense LM-head cross-entropy: the readable reference the fused paths are tested against.

It materialises the full [N, V] logits (fp32), so at V = 151,936 it needs N * 0.6 MB for the
logits alone, plus as much again for the softmax saved by autograd. Use it in tests and for
benchmarks, never in training at real vocabulary sizes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from trainer.kernels.common import LMHeadCE


def dense_lm_head_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> LMHeadCE:
    """Per-position CE and argmax-correctness from fully materialised logits.

    The matmul runs in the input dtype (what a plain torch training loop does); the softmax and the
    loss run in fp32. `torch.argmax` returns the lowest index among ties, which every fused path
    reproduces.
    """
    logits = (hidden @ weight.t()).float()
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="none")
    valid = labels != ignore_index
    correct = (logits.argmax(dim=-1) == labels) & valid
    return LMHeadCE(loss=loss, correct=correct)
