"""Result type and errors shared by every LM-head cross-entropy backend."""

from __future__ import annotations

from typing import Literal, NamedTuple, Protocol

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


class CEContext(Protocol):
    """The part of torch's autograd context the cross-entropy functions use (torch types it `Any`)."""

    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...

    def mark_non_differentiable(self, *args: torch.Tensor) -> None: ...


class SavedCE(NamedTuple):
    """What the backward of every fused cross-entropy reads back from its context."""

    hidden: torch.Tensor
    weight: torch.Tensor
    labels: torch.Tensor
    lse: torch.Tensor  # [N] fp32 log-sum-exp of the logits
    grad_rows: torch.Tensor  # [N] fp32 upstream gradient, 0 at ignored positions


def ce_forward_epilogue(
    ctx: CEContext,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    stats: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, correct) from a backend's (log-sum-exp, label logit, argmax); saves what backward needs.

    Ignored positions get loss 0 and correct False; `correct` is marked non-differentiable. Shared by
    the chunked and Triton autograd functions, which differ only in how they compute `stats`.
    """
    lse, label_logit, argmax = stats
    valid = labels != ignore_index
    loss = torch.where(valid, lse - label_logit, torch.zeros_like(lse))
    correct = (argmax == labels) & valid
    ctx.save_for_backward(hidden, weight, labels, lse, valid)
    ctx.mark_non_differentiable(correct)
    return loss, correct


def ce_backward_inputs(ctx: CEContext, grad_loss: torch.Tensor | None) -> SavedCE | None:
    """The saved tensors and the per-position gradient, or None when `hidden` needs no gradient."""
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return None
    hidden, weight, labels, lse, valid = ctx.saved_tensors
    grad_rows = torch.where(valid, grad_loss.float(), torch.zeros_like(lse)).contiguous()
    return SavedCE(hidden, weight, labels, lse, grad_rows)
