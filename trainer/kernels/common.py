"""Result type and errors shared by every LM-head cross-entropy backend."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from trainer.errors import TrainerError

Backend = Literal["auto", "triton", "chunked", "dense"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "chunked", "dense")


class LMHeadCE(NamedTuple):
    """Per-position results; ignored positions have loss 0 and correct False."""

    loss: torch.Tensor  # [N] float32, differentiable w.r.t. hidden
    correct: torch.Tensor  # [N] bool: argmax over the vocabulary == label


class KernelInputError(TrainerError, ValueError):
    """A caller passed tensors the kernel cannot use (shape, dtype, device, label range)."""


class BackendUnavailableError(TrainerError, RuntimeError):
    """An explicitly requested backend cannot run on this machine or for these tensors."""


def add_chunk_grad(grad: torch.Tensor, dlogits: torch.Tensor, w: torch.Tensor) -> None:
    """grad (fp32) += dlogits @ w for one vocabulary chunk, shared by the chunked and Triton backward.

    fp32 inputs accumulate in place; bf16/fp16 inputs multiply in their own dtype (tensor cores on
    GPU) and the product is summed in fp32, so the chunks never accumulate in low precision.
    """
    if w.dtype == torch.float32:
        grad.addmm_(dlogits, w)
    else:
        grad.add_(dlogits.to(w.dtype) @ w)
