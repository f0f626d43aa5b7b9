"""Chunked LM-head soft-label cross-entropy: logit distillation without ever holding [N, V].

`lm_head_distill_cross_entropy(student[N, D], teacher[N, D], weight[V, D], labels[N])` gives,
per row, H(p, q) = -sum_v p(v) log q(v) with p = softmax(teacher @ W.T) (the target's own
distribution, a constant) and q = softmax(student @ W.T) (the drafter's), the loss of ModelOpt's
`dflash_self_logit_distillation`, and in the same pass the hard-label CE of q against `labels`
and argmax == label (what a mixed loss, D-PACE's confidences and the metrics need): the
student's logits are computed once for both. The soft part's gradient is that of KL(p || q).

The same memory discipline as the chunked CE (`trainer.kernels.chunked`): the vocabulary is
walked in chunks of rows of W; forward keeps per row the student's online log-sum-exp, label
logit and running argmax, the teacher's log-sum-exp, and sum_v exp(t_v - max_t) s_v (rescaled
whenever max_t grows), so H(p, q) = lse_s - sum_v p(v) s_v comes out of one pass; backward
recomputes both chunks of logits from the saved hidden states and log-sum-exps and accumulates
grad_student += (q (g_soft + g_hard) - p g_soft - onehot g_hard) @ W_c in fp32: two logits
matmuls forward, three backward, where the CE alone takes one and two. At most two [N, chunk]
fp32 tiles are alive at a time (the student's and the teacher's), so the default chunk is half
the CE's default width (`distill_chunk_size`): the same bytes as the CE's one tile.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch.autograd.function import once_differentiable

from trainer.kernels.chunked import default_chunk_size
from trainer.kernels.common import KernelInputError, add_chunk_grad

_PREFIX = "lm_head_soft_cross_entropy"


def distill_chunk_size(n_rows: int, vocab: int) -> int:
    """Half the chunked CE's default width (at least 256): two tiles, the CE's one tile's bytes,
    whether the CE's byte budget or its width cap sets that width."""
    return max(256, default_chunk_size(n_rows, vocab) // 2)


class DistillCE(NamedTuple):
    """Per-row results of `lm_head_distill_cross_entropy`."""

    soft: torch.Tensor  # [N] float32 H(p_teacher, q_student), differentiable w.r.t. student
    hard: torch.Tensor  # [N] float32 CE(q_student, label), differentiable w.r.t. student
    correct: torch.Tensor  # [N] bool: the student's argmax == label (lowest index on ties)


def distill_forward(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, ...]:
    """(soft CE, hard CE, argmax, student lse, teacher lse), [N] each, fp32 (argmax: long)."""
    n, dev, f32 = student.shape[0], student.device, torch.float32
    s_max = torch.full((n,), float("-inf"), dtype=f32, device=dev)
    s_sum = torch.zeros(n, dtype=f32, device=dev)
    t_max = torch.full((n,), float("-inf"), dtype=f32, device=dev)
    t_sum = torch.zeros(n, dtype=f32, device=dev)
    t_dot = torch.zeros(n, dtype=f32, device=dev)  # sum_v exp(t_v - t_max) * s_v
    label_logit = torch.zeros(n, dtype=f32, device=dev)
    best = torch.full((n,), float("-inf"), dtype=f32, device=dev)
    best_idx = torch.zeros(n, dtype=torch.long, device=dev)
    for start in range(0, weight.shape[0], chunk_size):
        w = weight[start : start + chunk_size]
        s = (student @ w.t()).float()
        width = s.shape[1]
        # argmax and label logit as the chunked CE takes them (ties: the lowest index)
        c_idx = s.argmax(dim=1)
        c_max = s.gather(1, c_idx[:, None]).squeeze(1)
        better = c_max > best
        best = torch.where(better, c_max, best)
        best_idx = torch.where(better, c_idx + start, best_idx)
        in_chunk = (labels >= start) & (labels < start + width)
        picked = s.gather(1, (labels - start).clamp(0, width - 1)[:, None]).squeeze(1)
        label_logit = torch.where(in_chunk, picked, label_logit)
        t = (teacher @ w.t()).float()
        t_new = torch.maximum(t_max, t.amax(dim=1))
        rescale = torch.exp(t_max - t_new)
        e = t.sub_(t_new[:, None]).exp_()  # in place: the teacher's tile becomes exp(t - max)
        t_sum = t_sum * rescale + e.sum(dim=1)
        t_dot = t_dot * rescale + e.mul_(s).sum(dim=1)
        t_max = t_new
        s_new = torch.maximum(s_max, c_max)
        s_sum = s_sum * torch.exp(s_max - s_new) + s.sub_(s_new[:, None]).exp_().sum(dim=1)
        s_max = s_new
        del s, t, e  # before the next chunk's tiles exist: two tiles at a time, not three
    lse_s = s_max + torch.log(s_sum)
    lse_t = t_max + torch.log(t_sum)
    return lse_s - t_dot / t_sum, lse_s - label_logit, best_idx, lse_s, lse_t


def distill_grad_student(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: tuple[torch.Tensor, torch.Tensor],
    grads: tuple[torch.Tensor | None, torch.Tensor | None],
    chunk_size: int,
) -> torch.Tensor:
    """grad_student = sum over chunks of (q (g_soft + g_hard) - p g_soft - onehot g_hard) @ W_c
    in fp32; the teacher's logits are not recomputed when the soft part has no gradient."""
    lse_s, lse_t = lse
    g_soft, g_hard = (None if g is None else g.float()[:, None] for g in grads)
    g_q = g_soft if g_hard is None else g_hard if g_soft is None else g_soft + g_hard
    assert g_q is not None
    grad = torch.zeros(student.shape, dtype=torch.float32, device=student.device)
    for start in range(0, weight.shape[0], chunk_size):
        w = weight[start : start + chunk_size]
        d = (student @ w.t()).float().sub_(lse_s[:, None]).exp_().mul_(g_q)
        if g_soft is not None:
            p = (teacher @ w.t()).float().sub_(lse_t[:, None]).exp_()
            d.sub_(p.mul_(g_soft))
            del p
        if g_hard is not None:  # minus the onehot, without a host sync (0 where elsewhere)
            width = d.shape[1]
            in_chunk = ((labels >= start) & (labels < start + width)).float()[:, None]
            local = (labels - start).clamp(0, width - 1)[:, None]
            d.scatter_add_(1, local, -in_chunk * g_hard)
        add_chunk_grad(grad, d, w)
        del d
    return grad


class _Context(Protocol):
    saved_tensors: tuple[torch.Tensor, ...]
    needs_input_grad: tuple[bool, ...]
    chunk_size: int

    def save_for_backward(self, *tensors: torch.Tensor) -> None: ...

    def mark_non_differentiable(self, *args: torch.Tensor) -> None: ...


class ChunkedDistillCE(torch.autograd.Function):
    """Autograd wrapper: saves both hidden states, the labels and both log-sum-exps, never
    the logits."""

    @staticmethod
    def forward(
        ctx: _Context,
        student: torch.Tensor,
        teacher: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        soft, hard, argmax, lse_s, lse_t = distill_forward(
            student, teacher, weight, labels, chunk_size
        )
        ctx.chunk_size = chunk_size
        ctx.save_for_backward(student, teacher, weight, labels, lse_s, lse_t)
        correct = argmax == labels
        ctx.mark_non_differentiable(correct)
        return soft, hard, correct

    @staticmethod
    @once_differentiable
    def backward(
        ctx: _Context,
        grad_soft: torch.Tensor | None,
        grad_hard: torch.Tensor | None,
        _grad_correct: torch.Tensor | None,
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        if (grad_soft is None and grad_hard is None) or not ctx.needs_input_grad[0]:
            return None, None, None, None, None
        student, teacher, weight, labels, lse_s, lse_t = ctx.saved_tensors
        grad = distill_grad_student(
            student, teacher, weight, labels, (lse_s, lse_t), (grad_soft, grad_hard),
            ctx.chunk_size,
        )  # fmt: skip
        return grad.to(student.dtype), None, None, None, None


def lm_head_distill_cross_entropy(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> DistillCE:
    """Per row: the soft-label CE of `student @ weight.T` against softmax(`teacher @ weight.T`),
    and the hard-label CE against `labels` with argmax-correctness, in one pass.

    Args:
        student: [N, D] float, the drafter's hidden states; may require grad.
        teacher: [N, D], same dtype and device: the target's last (post-norm) hidden states at
            the positions whose next token the student predicts; never differentiated.
        weight: [V, D], the shared LM head; must not require grad (it is the target's, frozen).
        labels: [N] class ids in [0, V) (no ignored rows: pass the scored rows only).
        chunk_size: vocabulary chunk width (None: `distill_chunk_size`).

    Returns:
        DistillCE(soft, hard, correct); `soft` and `hard` differentiable w.r.t. `student` only.

    Raises:
        KernelInputError: shapes, dtypes, devices or labels the kernel cannot use.
    """
    _validate(student, teacher, weight)
    if labels.shape != student.shape[:1] or labels.is_floating_point():
        raise KernelInputError(
            f"{_PREFIX}: labels must be [N] = [{student.shape[0]}] class ids, got "
            f"{tuple(labels.shape)} {labels.dtype}"
        )
    if labels.device != student.device:
        raise KernelInputError(
            f"{_PREFIX}: labels are on {labels.device}, student on {student.device}"
        )
    if chunk_size is not None and chunk_size <= 0:
        raise KernelInputError(f"{_PREFIX}: chunk_size must be positive, got {chunk_size}")
    labels = labels.long()
    if student.shape[0] == 0:
        empty = student.new_zeros(0, dtype=torch.float32) + student.sum() * 0
        no = torch.zeros(0, dtype=torch.bool, device=student.device)
        return DistillCE(empty, empty, no)
    vocab = weight.shape[0]
    bad = (labels < 0) | (labels >= vocab)
    if labels.device.type != "cpu":  # checked on the device, no host sync (as the CE does)
        torch._assert_async(~bad.any(), f"{_PREFIX}: label(s) outside [0, {vocab})")
    elif bool(bad.any()):
        raise KernelInputError(
            f"{_PREFIX}: {int(bad.sum())} label(s) outside [0, {vocab}), e.g. {int(labels[bad][0])}"
        )
    width = chunk_size or distill_chunk_size(student.shape[0], vocab)
    # torch's Function.apply is unannotated; the types are forward's.
    soft, hard, correct = ChunkedDistillCE.apply(student, teacher.detach(), weight, labels, width)  # type: ignore[no-untyped-call]
    return DistillCE(soft, hard, correct)


def lm_head_soft_cross_entropy(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    *,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The soft-label CE alone ([N] float32): `lm_head_distill_cross_entropy` without labels."""
    labels = torch.zeros(student.shape[0], dtype=torch.long, device=student.device)
    out = lm_head_distill_cross_entropy(student, teacher, weight, labels, chunk_size=chunk_size)
    return out.soft


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
