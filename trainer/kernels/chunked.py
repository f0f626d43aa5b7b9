"""Chunked LM-head cross-entropy in pure torch: the path used wherever Triton cannot run.

Forward walks the vocabulary in chunks of `chunk_size` rows of the LM head, keeping per position a
running max, a rescaled sum of exponentials (online log-sum-exp), the label's logit and the running
argmax. Only one [N, chunk] fp32 logits tile is alive at a time. Backward recomputes each chunk's
logits from the saved hidden states and the log-sum-exp, forms (softmax - onehot) * dloss and
accumulates grad_hidden += dlogits_chunk @ W_chunk in fp32. Costs one extra LM-head matmul
(recompute) in exchange for never holding [N, V].
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.autograd.function import once_differentiable

from trainer.kernels.common import (
    CEContext,
    LMHeadCE,
    add_chunk_grad,
    ce_backward_inputs,
    ce_forward_epilogue,
)

DEFAULT_CHUNK_BYTES = 256 * 2**20
"""fp32 bytes one [N, chunk] logits tile may take; sets the default chunk width."""
MAX_CHUNK = 16384
"""Widest default chunk: beyond this the matmuls are already efficient and memory just grows."""


def default_chunk_size(n_rows: int, vocab: int, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Vocabulary chunk width: the byte budget's width, clamped to [256, MAX_CHUNK] and to V."""
    width = chunk_bytes // (4 * max(n_rows, 1))
    width = min(MAX_CHUNK, max(256, width // 256 * 256))
    return min(width, vocab)


def chunked_forward(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return (log-sum-exp [N], label logit [N], argmax [N]) without materialising [N, V].

    Labels outside the vocabulary (ignored positions) never match a chunk, so their label logit is
    0; the caller masks them.
    """
    n, vocab = hidden.shape[0], weight.shape[0]
    dev = hidden.device
    # fp32 named, not defaulted: the default dtype is process-global (a thread loading a bf16
    # model flips it), and these accumulators must stay fp32 whatever another thread does.
    f32 = torch.float32
    run_max = torch.full((n,), float("-inf"), dtype=f32, device=dev)
    run_sum = torch.zeros(n, dtype=f32, device=dev)
    label_logit = torch.zeros(n, dtype=f32, device=dev)
    best = torch.full((n,), float("-inf"), dtype=f32, device=dev)
    best_idx = torch.zeros(n, dtype=torch.long, device=dev)
    for start in range(0, vocab, chunk_size):
        logits = (hidden @ weight[start : start + chunk_size].t()).float()
        width = logits.shape[1]
        # argmax first: ties resolve to the lowest index inside the chunk (torch.argmax), and the
        # strict ">" below keeps the earlier chunk on ties across chunks.
        c_idx = logits.argmax(dim=1)
        c_max = logits.gather(1, c_idx[:, None]).squeeze(1)
        better = c_max > best
        best = torch.where(better, c_max, best)
        best_idx = torch.where(better, c_idx + start, best_idx)
        in_chunk = (labels >= start) & (labels < start + width)
        local = (labels - start).clamp(0, width - 1)
        picked = logits.gather(1, local[:, None]).squeeze(1)
        label_logit = torch.where(in_chunk, picked, label_logit)
        new_max = torch.maximum(run_max, c_max)
        # In place: the exponentials reuse the logits buffer, so one tile is the peak.
        chunk_sum = logits.sub_(new_max[:, None]).exp_().sum(dim=1)
        run_sum = run_sum * torch.exp(run_max - new_max) + chunk_sum
        run_max = new_max
    return run_max + torch.log(run_sum), label_logit, best_idx


def chunked_grad_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    chunk_size: int,
) -> torch.Tensor:
    """grad_hidden = sum over chunks of ((softmax - onehot) * grad_rows) @ W_chunk, fp32 accumulation.

    `grad_rows` is the upstream gradient of each position's loss, already zero at ignored positions.
    """
    vocab = weight.shape[0]
    grad = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    scale = grad_rows.float()[:, None]
    for start in range(0, vocab, chunk_size):
        w = weight[start : start + chunk_size]
        probs = (hidden @ w.t()).float().sub_(lse[:, None]).exp_()
        width = probs.shape[1]
        in_chunk = ((labels >= start) & (labels < start + width)).float()
        local = (labels - start).clamp(0, width - 1)
        # Subtract the onehot without a host sync: rows whose label is elsewhere subtract 0.
        probs.scatter_add_(1, local[:, None], -in_chunk[:, None])
        probs.mul_(scale)
        add_chunk_grad(grad, probs, w)
    return grad


class _ChunkedContext(CEContext, Protocol):
    chunk_size: int


class ChunkedLMHeadCE(torch.autograd.Function):
    """Autograd wrapper: saves hidden, labels and the log-sum-exp, never the logits."""

    @staticmethod
    def forward(
        ctx: _ChunkedContext,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        chunk_size: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stats = chunked_forward(hidden, weight, labels, chunk_size)
        ctx.chunk_size = chunk_size
        return ce_forward_epilogue(ctx, hidden, weight, labels, ignore_index, stats)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: _ChunkedContext, grad_loss: torch.Tensor | None, _grad_correct: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None]:
        saved = ce_backward_inputs(ctx, grad_loss)
        if saved is None:
            return None, None, None, None, None
        h, w, labels, lse, grad_rows = saved
        grad = chunked_grad_hidden(h, w, labels, lse, grad_rows, ctx.chunk_size)
        return grad.to(h.dtype), None, None, None, None


def chunked_lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    chunk_size: int,
) -> LMHeadCE:
    """Validated inputs in, LMHeadCE out (the chunked backend of `lm_head_cross_entropy`)."""
    # torch's Function.apply is unannotated; the types are forward's.
    loss, correct = ChunkedLMHeadCE.apply(hidden, weight, labels, ignore_index, chunk_size)  # type: ignore[no-untyped-call]
    return LMHeadCE(loss=loss, correct=correct)
