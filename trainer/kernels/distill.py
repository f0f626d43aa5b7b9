"""Chunked LM-head soft-label cross-entropy: logit distillation without ever holding [N, V].

`lm_head_soft_cross_entropy(student[N, D], teacher[N, D], weight[V, D])` is, per row,
H(p, q) = -sum_v p(v) log q(v) with p = softmax(teacher @ W.T) (the target's own distribution,
a constant) and q = softmax(student @ W.T) (the drafter's), the loss of ModelOpt's
`dflash_self_logit_distillation`. Its gradient is that of KL(p || q): (q - p) @ W.

The same memory discipline as the chunked CE (`trainer.kernels.chunked`): the vocabulary is
walked in chunks of rows of W; forward keeps per row the student's online log-sum-exp and the
teacher's, plus sum_v exp(t_v - max_t) s_v (rescaled whenever max_t grows), so
H(p, q) = lse_s - sum_v p(v) s_v comes out of one pass; backward recomputes both chunks of logits
from the saved hidden states and log-sum-exps and accumulates grad_student += ((q - p) * g) @ W_c
in fp32. At most two [N, chunk] fp32 tiles are alive at a time (the student's and the
teacher's), so the default chunk is sized to half the CE's tile budget.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.autograd.function import once_differentiable

from trainer.kernels.chunked import DEFAULT_CHUNK_BYTES, default_chunk_size
from trainer.kernels.common import KernelInputError, add_chunk_grad

_PREFIX = "lm_head_soft_cross_entropy"


def soft_forward(
    student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(soft CE [N], student log-sum-exp [N], teacher log-sum-exp [N]), all fp32."""
    n, dev, f32 = student.shape[0], student.device, torch.float32
    s_max = torch.full((n,), float("-inf"), dtype=f32, device=dev)
    s_sum = torch.zeros(n, dtype=f32, device=dev)
    t_max = torch.full((n,), float("-inf"), dtype=f32, device=dev)
    t_sum = torch.zeros(n, dtype=f32, device=dev)
    t_dot = torch.zeros(n, dtype=f32, device=dev)  # sum_v exp(t_v - t_max) * s_v
    for start in range(0, weight.shape[0], chunk_size):
        w = weight[start : start + chunk_size]
        s = (student @ w.t()).float()
        t = (teacher @ w.t()).float()
        t_new = torch.maximum(t_max, t.amax(dim=1))
        rescale = torch.exp(t_max - t_new)
        e = t.sub_(t_new[:, None]).exp_()  # in place: the teacher's tile becomes exp(t - max)
        t_sum = t_sum * rescale + e.sum(dim=1)
        t_dot = t_dot * rescale + e.mul_(s).sum(dim=1)
        t_max = t_new
        s_new = torch.maximum(s_max, s.amax(dim=1))
        s_sum = s_sum * torch.exp(s_max - s_new) + s.sub_(s_new[:, None]).exp_().sum(dim=1)
        s_max = s_new
        del s, t, e  # before the next chunk's tiles exist: two tiles at a time, not three
    lse_s = s_max + torch.log(s_sum)
    lse_t = t_max + torch.log(t_sum)
    return lse_s - t_dot / t_sum, lse_s, lse_t


def soft_grad_student(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    lse_s: torch.Tensor,
    lse_t: torch.Tensor,
    grad_rows: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """grad_student = sum over chunks of ((q - p) * grad_rows) @ W_chunk, fp32 accumulation."""
    grad = torch.zeros(student.shape, dtype=torch.float32, device=student.device)
    scale = grad_rows.float()[:, None]
    for start in range(0, weight.shape[0], chunk_size):
        w = weight[start : start + chunk_size]
        q = (student @ w.t()).float().sub_(lse_s[:, None]).exp_()
        p = (teacher @ w.t()).float().sub_(lse_t[:, None]).exp_()
        add_chunk_grad(grad, q.sub_(p).mul_(scale), w)
        del q, p
    return grad


class _Context(Protocol):
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]
    chunk_size: int

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...


class ChunkedSoftCE(torch.autograd.Function):
    """Autograd wrapper: saves both hidden states and both log-sum-exps, never the logits."""

    @staticmethod
    def forward(
        ctx: _Context,
        student: torch.Tensor,
        teacher: torch.Tensor,
        weight: torch.Tensor,
        chunk_size: int,
    ) -> torch.Tensor:
        loss, lse_s, lse_t = soft_forward(student, teacher, weight, chunk_size)
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(student, teacher, weight, lse_s, lse_t)
        return loss

    @staticmethod
    @once_differentiable
    def backward(
        ctx: _Context, grad_loss: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None]:
        if grad_loss is None or not ctx.needs_input_grad[0]:
            return None, None, None, None
        student, teacher, weight, lse_s, lse_t = ctx.saved_tensors
        grad = soft_grad_student(
            student, teacher, weight, lse_s, lse_t, grad_loss.contiguous(), ctx.chunk_size
        )
        return grad.to(student.dtype), None, None, None


def lm_head_soft_cross_entropy(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Per-row soft-label CE of `student @ weight.T` against softmax(`teacher @ weight.T`).

    Args:
        student: [N, D] float, the drafter's hidden states; may require grad.
        teacher: [N, D], same dtype and device: the target's last (post-norm) hidden states at
            the positions whose next token the student predicts; never differentiated.
        weight: [V, D], the shared LM head; must not require grad (it is the target's, frozen).
        chunk_size: vocabulary chunk width (None: two fp32 tiles within the CE's budget).

    Returns:
        [N] float32, differentiable w.r.t. `student` only.

    Raises:
        KernelInputError: shapes, dtypes or devices the kernel cannot use.
    """
    _validate(student, teacher, weight)
    if chunk_size is not None and chunk_size <= 0:
        raise KernelInputError(f"{_PREFIX}: chunk_size must be positive, got {chunk_size}")
    if student.shape[0] == 0:
        return student.new_zeros(0, dtype=torch.float32) + student.sum() * 0
    vocab = weight.shape[0]
    width = chunk_size or default_chunk_size(student.shape[0], vocab, DEFAULT_CHUNK_BYTES // 2)
    # torch's Function.apply is unannotated; the type is forward's.
    loss: torch.Tensor = ChunkedSoftCE.apply(student, teacher.detach(), weight, width)  # type: ignore[no-untyped-call]
    return loss


def _validate(student: torch.Tensor, teacher: torch.Tensor, weight: torch.Tensor) -> None:
    if student.dim() != 2 or teacher.shape != student.shape:
        raise KernelInputError(
            f"{_PREFIX}: student and teacher must both be [N, D], got {tuple(student.shape)} "
            f"and {tuple(teacher.shape)}"
        )
    if weight.dim() != 2 or weight.shape[1] != student.shape[1]:
        raise KernelInputError(
            f"{_PREFIX}: weight must be [V, {student.shape[1]}], got {tuple(weight.shape)}"
        )
    if not student.is_floating_point() or not (student.dtype == teacher.dtype == weight.dtype):
        raise KernelInputError(
            f"{_PREFIX}: student, teacher and weight must share a float dtype, got "
            f"{student.dtype}, {teacher.dtype} and {weight.dtype}"
        )
    if not (student.device == teacher.device == weight.device):
        raise KernelInputError(
            f"{_PREFIX}: student, teacher and weight must be on one device, got "
            f"{student.device}, {teacher.device} and {weight.device}"
        )
    if weight.requires_grad and torch.is_grad_enabled():
        raise KernelInputError(
            f"{_PREFIX}: weight requires grad, but the LM head is frozen here and gets no "
            "gradient; call weight.requires_grad_(False) or pass weight.detach()"
        )
