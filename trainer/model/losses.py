"""The drafter's per-slot losses and their weights (`[model.loss]`), from the papers' formulas.

Every scored slot k (1..B-1) of a block gets a loss and a weight; the objective returns
sum(weight * loss) and sum(weight), and the pipeline divides the first by the second summed
over every micro-step and rank (one global normalisation, whatever the loss).

- `ce` (DFlash, arXiv 2602.06036): loss = CE(slot, x_{a+k}); weight = exp(-(k-1)/gamma).
- `dpace` (D-PACE, arXiv 2605.18810): loss = CE; weight, per block, from the drafter's own
  detached confidences q_i = exp(-CE_i): q~_i = (1 - alpha) q_i + alpha, C_j = prod_{i<=j} q~_i,
  w_j = sum_{m>=j} C_m. The fixed decay is dropped: D-PACE's weights replace it, as in SpecForge
  (`specforge/core/dflash.py`: the decay is applied in the "dflash" branch only) and ModelOpt
  (`hf_dflash.py` `_compute_loss`: "dynamic D-PACE weights or static exponential decay");
  w_j already falls along the block (a suffix sum of a falling product). Unsupervised slots
  are multiplicative no-ops in the product and left out of the sums (both references), and
  get weight 0.
- `kd_weight` = lambda > 0: loss = (1 - lambda) CE + lambda H(p_target, q_drafter), where
  p_target is the target's own next-token distribution at position a+k-1 (its last, post-norm
  hidden state through the shared LM head): ModelOpt's `dflash_self_logit_distillation` at
  lambda = 1. The weights are the loss type's (D-PACE's confidences stay the hard-label CE's,
  as in ModelOpt). Computed chunk-wise, with the hard CE in the same pass
  (`trainer.kernels.lm_head_distill_cross_entropy`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from trainer.config import LossConfig
from trainer.kernels import lm_head_cross_entropy, lm_head_distill_cross_entropy
from trainer.kernels.common import Backend

CE = LossConfig()
"""The default loss: decayed CE, no distillation."""


class SlotLosses(NamedTuple):
    """The scored slots' losses, weights and argmax-correctness, in the caller's slot order."""

    loss: Tensor  # [M] float32, differentiable
    weight: Tensor  # [M] float32, detached
    correct: Tensor  # [M] bool (hard-label argmax == label)


def slot_weights(block_size: int, gamma: float, device: torch.device | None = None) -> Tensor:
    """exp(-(k-1)/gamma) for slots k = 1..B-1 (slot 0 is the anchor and never scored)."""
    k = torch.arange(1, block_size, dtype=torch.float32, device=device)
    return torch.exp(-(k - 1) / gamma)


@torch.no_grad()
def dpace_weights(ce: Tensor, valid: Tensor, alpha: float) -> Tensor:
    """D-PACE weights [..., K] of each block's slots (last dim) from their CE [..., K].

    q~ = (1 - alpha) exp(-CE) + alpha on valid slots and 1 on the others; C = cumprod(q~);
    w_j = sum over valid m >= j of C_m; invalid slots get 0. Detached (the paper's Eq. 9)."""
    if not 0 < alpha <= 1:
        raise ValueError(f"D-PACE alpha must be in (0, 1], got {alpha}")
    smoothed = (1.0 - alpha) * torch.exp(-ce.float()) + alpha
    cum = torch.cumprod(torch.where(valid, smoothed, torch.ones_like(smoothed)), dim=-1)
    cum = cum * valid
    suffix = cum.flip(-1).cumsum(-1).flip(-1)
    return suffix * valid


def teacher_rows(positions: Tensor, seq: int, idx: Tensor, block_size: int) -> Tensor:
    """Flat indices into [R * S] of the position whose next-token distribution teaches each
    scored slot: slot k of block (r, n) with anchor a learns token a+k, which the target
    predicts at a+k-1. `idx` are the scored slots' flat indices into [R, N, B-1]."""
    rows = positions.shape[0]
    k = torch.arange(block_size - 1, device=positions.device)  # = slot - 1
    row_start = torch.arange(rows, device=positions.device)[:, None, None] * seq
    flat = row_start + positions[:, :, None] + k  # [R, N, B-1]: r * S + a + k - 1
    return flat.flatten().index_select(0, idx)


def slot_losses(
    hidden: Tensor,
    head: Tensor,
    labels: Tensor,
    *,
    loss: LossConfig,
    block_weights: Tensor,
    blocks: tuple[Tensor, Tensor],
    teacher: Tensor | None = None,
    ce_backend: Backend = "auto",
) -> SlotLosses:
    """Loss, weight and correctness of M scored slots.

    Args:
        hidden: [M, D] the drafter's outputs at the scored slots, in the head's dtype.
        head: [V, D] the borrowed LM head.
        labels: [M] the slots' labels.
        loss: `[model.loss]`.
        block_weights: [M] the fixed decay of each slot (used by `ce` only).
        blocks: (idx [M], valid [R, N, K]): the slots' flat indices into the blocks' valid
            slots, for D-PACE's per-block products.
        teacher: [M, D] the target's last hidden state teaching each slot (kd_weight > 0).
        ce_backend: the hard-label CE's backend when nothing is distilled (distillation runs
            the chunked torch pass of `lm_head_distill_cross_entropy`).
    """
    lam = loss.kd_weight
    if lam == 0:
        ce = lm_head_cross_entropy(hidden, head, labels, backend=ce_backend)
        hard, per_slot, correct = ce.loss, ce.loss, ce.correct
    else:
        if teacher is None:
            raise ValueError("kd_weight > 0 needs the target's last hidden state (teacher)")
        # one pass gives the soft CE, the hard CE and the argmax (the student's logits once)
        out = lm_head_distill_cross_entropy(hidden, teacher.to(head.dtype), head, labels)
        hard, correct = out.hard, out.correct
        # kd_weight 1: the hard CE feeds D-PACE's weights and the metrics, not the gradient
        per_slot = out.soft if lam == 1 else (1 - lam) * out.hard + lam * out.soft
    if loss.type == "dpace":
        idx, valid = blocks
        dense = torch.zeros(valid.numel(), dtype=torch.float32, device=valid.device)
        dense = dense.index_copy(0, idx, hard.detach()).view_as(valid)
        weight = dpace_weights(dense, valid, loss.dpace_alpha).flatten().index_select(0, idx)
    else:
        weight = block_weights
    return SlotLosses(per_slot, weight, correct)
