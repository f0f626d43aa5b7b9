"""Public entry point of the fused LM-head + cross-entropy: validation and backend selection.

`lm_head_cross_entropy(hidden[N, D], weight[V, D], labels[N])` returns per-position CE and
argmax-correctness without materialising [N, V] logits (except the "dense" reference backend).
Differentiable w.r.t. `hidden` only: the LM head is the target's frozen weight, and a weight that
requires grad is refused rather than silently left without one.

Backends:
  "triton"  fused Triton kernels (CUDA; CPU only through TRITON_INTERPRET=1, for tests);
  "chunked" pure torch, vocabulary chunks with an online log-sum-exp (runs anywhere);
  "dense"   full logits, the test reference;
  "auto"    "triton" for CUDA tensors (when triton imports) or when TRITON_INTERPRET=1 is set,
            "chunked" otherwise.
Argmax ties resolve to the lowest vocabulary index on every backend (torch.argmax's rule).
"""

from __future__ import annotations

import os
from typing import Protocol

import torch

from trainer.kernels.chunked import chunked_lm_head_cross_entropy, default_chunk_size
from trainer.kernels.common import (
    BACKENDS,
    Backend,
    BackendUnavailableError,
    KernelInputError,
    LMHeadCE,
)
from trainer.kernels.reference import dense_lm_head_cross_entropy

_PREFIX = "lm_head_cross_entropy"


def lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ignore_index: int = -100,
    backend: Backend = "auto",
    chunk_size: int | None = None,
) -> LMHeadCE:
    """Per-position cross-entropy of `hidden @ weight.T` against `labels`, and argmax == label.

    Args:
        hidden: [N, D] float (fp32 on CPU; bf16/fp16/fp32 on CUDA); may require grad.
        weight: [V, D], same dtype and device as `hidden`; must not require grad.
        labels: [N] integer class ids in [0, V), or `ignore_index`.
        ignore_index: label value whose position gets loss 0, correct False and zero gradient.
        backend: "auto", "triton", "chunked" or "dense" (see the module docstring).
        chunk_size: vocabulary chunk width of the chunked path (None: sized to <= 256 MiB of
            fp32 logits, at most 16384 wide); the Triton path sizes its own tiles.

    Returns:
        LMHeadCE(loss=[N] float32, correct=[N] bool).

    Raises:
        KernelInputError: shapes, dtypes, devices or label values the kernel cannot use.
        BackendUnavailableError: an explicitly requested backend cannot run here.
    """
    labels = _validate(hidden, weight, labels, ignore_index)
    if chunk_size is not None and chunk_size <= 0:
        raise KernelInputError(f"{_PREFIX}: chunk_size must be positive, got {chunk_size}")
    chosen = select_backend(backend, hidden.device, hidden.dtype)
    if hidden.shape[0] == 0:
        empty = hidden.new_zeros(0, dtype=torch.float32) + hidden.sum() * 0
        return LMHeadCE(loss=empty, correct=torch.zeros(0, dtype=torch.bool, device=hidden.device))
    if chosen == "dense":
        return dense_lm_head_cross_entropy(hidden, weight, labels, ignore_index)
    if chosen == "triton":
        return _triton().triton_lm_head_cross_entropy(hidden, weight, labels, ignore_index)
    width = chunk_size or default_chunk_size(hidden.shape[0], weight.shape[0])
    return chunked_lm_head_cross_entropy(hidden, weight, labels, ignore_index, width)


def select_backend(backend: str, device: torch.device, dtype: torch.dtype = torch.float32) -> str:
    """Resolve "auto" and check that an explicit choice can run on `device` with `dtype`."""
    if backend not in BACKENDS:
        raise KernelInputError(
            f"{_PREFIX}: backend must be one of {list(BACKENDS)}, got {backend!r}"
        )
    if backend in ("chunked", "dense"):
        return backend
    interpret_requested = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if backend == "auto":
        if device.type != "cuda" and not interpret_requested:
            return "chunked"
        return "triton" if triton_unavailable_reason(device, dtype) is None else "chunked"
    reason = triton_unavailable_reason(device, dtype)
    if reason is not None:
        raise BackendUnavailableError(f"{_PREFIX}: backend='triton' cannot run: {reason}")
    return "triton"


def triton_unavailable_reason(
    device: torch.device, dtype: torch.dtype = torch.float32
) -> str | None:
    """None when the Triton kernels can run on `device` tensors of `dtype`, else a one-line reason."""
    try:
        module = _triton()
    except ImportError as exc:
        return f"triton failed to import ({exc}); use backend='chunked'"
    if device.type == "cuda":
        if dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) < (8, 0):
            return f"bf16 tensor-core dots need compute capability 8.0+ ({device}); use fp16/fp32"
        return None
    if module.INTERPRETED:
        # The interpreter reads bf16/fp16 buffers as raw integers: results would be garbage.
        if dtype != torch.float32:
            return f"the Triton CPU interpreter supports float32 inputs only, got {dtype}"
        return None
    return (
        f"tensors are on {device.type}; Triton runs on CUDA, or on CPU only when TRITON_INTERPRET=1 "
        "is set before trainer.kernels.triton_ce is first imported; use backend='chunked'"
    )


class _TritonModule(Protocol):
    """What this module uses of `trainer.kernels.triton_ce` (a module satisfies a Protocol)."""

    INTERPRETED: bool

    def triton_lm_head_cross_entropy(
        self, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
    ) -> LMHeadCE: ...


def _triton() -> _TritonModule:
    """Import the Triton module lazily: importing triton costs ~1 s and is pointless on CPU."""
    from trainer.kernels import triton_ce

    return triton_ce


def _validate(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """Check the call and return labels as int64; every failure is one line naming the argument."""
    if hidden.dim() != 2 or weight.dim() != 2:
        raise KernelInputError(
            f"{_PREFIX}: hidden must be [N, D] and weight [V, D], got hidden {tuple(hidden.shape)} "
            f"and weight {tuple(weight.shape)} (flatten batch and time first)"
        )
    if hidden.shape[1] != weight.shape[1]:
        raise KernelInputError(
            f"{_PREFIX}: hidden size mismatch: hidden {tuple(hidden.shape)} vs weight "
            f"{tuple(weight.shape)}"
        )
    if labels.dim() != 1 or labels.shape[0] != hidden.shape[0]:
        raise KernelInputError(
            f"{_PREFIX}: labels must be [N={hidden.shape[0]}], got {tuple(labels.shape)}"
        )
    if not hidden.is_floating_point() or weight.dtype != hidden.dtype:
        raise KernelInputError(
            f"{_PREFIX}: hidden and weight must share a float dtype, got {hidden.dtype} and "
            f"{weight.dtype}"
        )
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise KernelInputError(f"{_PREFIX}: labels must be integer class ids, got {labels.dtype}")
    if not (hidden.device == weight.device == labels.device):
        raise KernelInputError(
            f"{_PREFIX}: hidden, weight and labels must be on one device, got {hidden.device}, "
            f"{weight.device} and {labels.device}"
        )
    if weight.requires_grad and torch.is_grad_enabled():
        raise KernelInputError(
            f"{_PREFIX}: weight requires grad, but the LM head is frozen here and gets no gradient; "
            "call weight.requires_grad_(False) or pass weight.detach()"
        )
    labels = labels.long()
    _check_label_range(labels, weight.shape[0], ignore_index)
    return labels


def _check_label_range(labels: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Every label is a row of the head or `ignore_index` (a silent wrong loss is far more
    expensive than the check). Host tensors: checked here, KernelInputError naming the count
    and one of them. Device tensors: checked on the device (`torch._assert_async`), so the
    call never waits for the device (it was a host sync per call, per drafter micro-step); a
    bad label fails the device's next synchronisation with this message instead."""
    bad = (labels != ignore_index) & ((labels < 0) | (labels >= vocab))
    what = f"label(s) outside [0, {vocab}) and not ignore_index={ignore_index}"
    if labels.device.type != "cpu":
        torch._assert_async(~bad.any(), f"{_PREFIX}: {what}")
        return
    if bool(bad.any()):
        first = int(labels[bad][0])
        raise KernelInputError(f"{_PREFIX}: {int(bad.sum())} {what}, e.g. {first}")
