"""Fused LM-head + cross-entropy in Triton: logits are computed tile by tile and never stored whole.

Forward (`_forward_kernel`): the grid is (position blocks, vocabulary splits). Each program walks its
split in [BLOCK_N, BLOCK_V] logits tiles (tl.dot over D in BLOCK_D steps, fp32 accumulation) and
keeps per row a running max, a rescaled sum of exponentials (online log-sum-exp), the label's logit
and the running argmax (strict ">" across tiles and tl.argmax's left tie-break inside a tile, so
ties resolve to the lowest vocabulary id like torch.argmax). Splits give small-N calls enough
programs to fill the GPU; their [S, N] partials are merged by a few torch ops.

Backward (`_dlogits_kernel`): for one vocabulary chunk at a time the kernel recomputes the logits
tile, forms dloss * (softmax - onehot) and writes it in the input dtype into a reusable [N, chunk]
buffer; grad_hidden accumulates chunk @ W_chunk in fp32 through cuBLAS. The chunk is at most
256 MiB and 16384 ids wide, so the full [N, V] logits never exist, while the expensive grad matmul stays on the
vendor GEMM (a fully fused dE would need a [BLOCK_N, D] accumulator — 2 MiB at D = 4096 — or
atomics over V / BLOCK_V partial sums).

TRITON_INTERPRET=1 must be set before this module is first imported for the kernels to run on CPU
tensors (Triton's jit decorator reads it at decoration time); `INTERPRETED` records which mode the
kernels were built in.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import ParamSpec, Protocol, TypeVar

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from trainer.kernels.common import (
    CEContext,
    LMHeadCE,
    add_chunk_grad,
    ce_backward_inputs,
    ce_forward_epilogue,
)

DLOGITS_CHUNK_BYTES = 256 * 2**20
"""Bytes of the reusable [N, chunk] dlogits buffer of the backward pass."""
MAX_DLOGITS_CHUNK = 16384
"""Widest backward chunk: wide enough for efficient GEMMs, small enough for small-N calls."""


_P = ParamSpec("_P")
_R = TypeVar("_R")
_R_co = TypeVar("_R_co", covariant=True)


class JitFunction(Protocol[_P, _R_co]):
    """A `triton.jit` function: launched as `kernel[grid](..., num_warps=...)` from the host, called
    as `f(...)` from another kernel."""

    __name__: str
    arg_names: list[str]

    def __call__(self, *args: _P.args, **kwargs: _P.kwargs) -> _R_co: ...

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]: ...


def _jit(
    *, do_not_specialize: Sequence[str] | None = None
) -> Callable[[Callable[_P, _R]], JitFunction[_P, _R]]:
    """`triton.jit`, typed: triton ships no type information, so its decorator is untyped.

    Kernel parameters are annotated `tl.tensor` (what a non-constexpr argument is inside a kernel):
    the jit reads annotations, and a builtin name (`int`, `float`) would become a Triton type
    ("i32", "fp32") and change how the argument is specialised.
    """

    def wrap(fn: Callable[_P, _R]) -> JitFunction[_P, _R]:
        names = list(do_not_specialize) if do_not_specialize is not None else None
        jitted: JitFunction[_P, _R] = triton.jit(fn, do_not_specialize=names)
        return jitted

    return wrap


@_jit()
def _logits_tile(
    h_ptr: tl.tensor,
    w_ptr: tl.tensor,
    rows: tl.tensor,
    row_ok: tl.tensor,
    cols: tl.tensor,
    col_ok: tl.tensor,
    D: tl.tensor,
    stride_hn: tl.tensor,
    stride_hd: tl.tensor,
    stride_wv: tl.tensor,
    stride_wd: tl.tensor,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
) -> tl.tensor:
    """[BLOCK_N, BLOCK_V] fp32 logits of rows x cols; out-of-range rows/cols read zeros."""
    acc = tl.zeros([BLOCK_N, BLOCK_V], dtype=tl.float32)
    rows64 = rows.to(tl.int64)
    cols64 = cols.to(tl.int64)  # V * D can exceed 2**31 (e.g. 256K x 8192)
    for d0 in range(0, D, BLOCK_D):
        ds = d0 + tl.arange(0, BLOCK_D)
        d_ok = ds < D
        h = tl.load(
            h_ptr + rows64[:, None] * stride_hn + ds[None, :] * stride_hd,
            mask=row_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        w_t = tl.load(
            w_ptr + ds[:, None] * stride_wd + cols64[None, :] * stride_wv,
            mask=d_ok[:, None] & col_ok[None, :],
            other=0.0,
        )
        acc = tl.dot(h, w_t, acc, input_precision=PRECISION)
    return acc


@_jit(do_not_specialize=["N", "V", "v_per_split"])
def _forward_kernel(
    h_ptr: tl.tensor,
    w_ptr: tl.tensor,
    labels_ptr: tl.tensor,
    max_ptr: tl.tensor,
    sum_ptr: tl.tensor,
    label_logit_ptr: tl.tensor,
    best_ptr: tl.tensor,
    best_idx_ptr: tl.tensor,
    N: tl.tensor,
    V: tl.tensor,
    D: tl.tensor,
    v_per_split: tl.tensor,
    stride_hn: tl.tensor,
    stride_hd: tl.tensor,
    stride_wv: tl.tensor,
    stride_wd: tl.tensor,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
) -> None:
    """Partial (max, sum-exp, label logit, best logit, best id) of one row block over one split."""
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    v_start = pid_s * v_per_split
    v_end = tl.minimum(v_start + v_per_split, V)
    run_max = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    run_sum = tl.zeros([BLOCK_N], dtype=tl.float32)
    label_logit = tl.zeros([BLOCK_N], dtype=tl.float32)
    best = tl.full([BLOCK_N], float("-inf"), dtype=tl.float32)
    best_idx = tl.zeros([BLOCK_N], dtype=tl.int32)
    for v0 in range(v_start, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_end
        logits = _logits_tile(
            h_ptr, w_ptr, rows, row_ok, cols, col_ok, D, stride_hn, stride_hd, stride_wv,
            stride_wd, BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
        )  # fmt: skip
        logits = tl.where(col_ok[None, :], logits, float("-inf"))
        tile_max = tl.max(logits, axis=1)
        tile_arg = tl.argmax(logits, axis=1, tie_break_left=True)
        better = tile_max > best  # strict: an earlier tile keeps ties
        best = tl.where(better, tile_max, best)
        best_idx = tl.where(better, v0 + tile_arg, best_idx)
        is_label = cols[None, :] == labels[:, None]
        label_logit += tl.sum(tl.where(is_label, logits, 0.0), axis=1)
        new_max = tl.maximum(run_max, tile_max)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.sum(
            tl.exp(logits - new_max[:, None]), axis=1
        )
        run_max = new_max
    out = pid_s * N + rows
    tl.store(max_ptr + out, run_max, mask=row_ok)
    tl.store(sum_ptr + out, run_sum, mask=row_ok)
    tl.store(label_logit_ptr + out, label_logit, mask=row_ok)
    tl.store(best_ptr + out, best, mask=row_ok)
    tl.store(best_idx_ptr + out, best_idx, mask=row_ok)


@_jit(do_not_specialize=["N", "v_start", "v_width"])
def _dlogits_kernel(
    h_ptr: tl.tensor,
    w_ptr: tl.tensor,
    labels_ptr: tl.tensor,
    lse_ptr: tl.tensor,
    grad_rows_ptr: tl.tensor,
    out_ptr: tl.tensor,
    N: tl.tensor,
    D: tl.tensor,
    v_start: tl.tensor,
    v_width: tl.tensor,
    stride_hn: tl.tensor,
    stride_hd: tl.tensor,
    stride_wv: tl.tensor,
    stride_wd: tl.tensor,
    stride_on: tl.tensor,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_D: tl.constexpr,
    PRECISION: tl.constexpr,
) -> None:
    """out[n, j] = grad_rows[n] * (softmax[n, v_start + j] - [label[n] == v_start + j])."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    local = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = local < v_width
    cols = v_start + local
    logits = _logits_tile(
        h_ptr, w_ptr, rows, row_ok, cols, col_ok, D, stride_hn, stride_hd, stride_wv, stride_wd,
        BLOCK_N, BLOCK_V, BLOCK_D, PRECISION,
    )  # fmt: skip
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    scale = tl.load(grad_rows_ptr + rows, mask=row_ok, other=0.0)
    labels = tl.load(labels_ptr + rows, mask=row_ok, other=-1)
    probs = tl.exp(logits - lse[:, None])
    probs = tl.where(cols[None, :] == labels[:, None], probs - 1.0, probs)
    dlogits = probs * scale[:, None]
    ptrs = out_ptr + rows.to(tl.int64)[:, None] * stride_on + local[None, :]
    tl.store(ptrs, dlogits.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


# Sizes that vary call to call (N, vocabulary offsets) are not specialised, so a training run
# compiles each kernel once per dtype instead of once per batch shape; D and the strides stay
# specialised because 16-divisibility enables vectorised, pipelined loads.


def _built_for_interpreter() -> bool:
    """Whether the kernels were built for the interpreter; ImportError when triton.language's own
    jit helpers (tl.max, tl.argmax, tl.sum: the kernels call them) were built in the other mode.

    Each module reads TRITON_INTERPRET as its functions are decorated, so triton first imported
    without it (torch and transformers import triton) and this module imported with it would give
    interpreted kernels calling compiled helpers, which fail at the first launch with "Cannot call
    @triton.jit'd outside of the scope of a kernel" (and the other way round fails to compile).
    """
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:  # layout changed in a future triton: fall back to the documented switch
        return bool(triton.knobs.runtime.interpret)
    kernels = isinstance(_forward_kernel, InterpretedFunction)
    helpers = isinstance(tl.argmax, InterpretedFunction)
    if kernels != helpers:
        mode = {True: "the CPU interpreter", False: "compilation"}
        raise ImportError(
            f"triton.language was built for {mode[helpers]} but these kernels for {mode[kernels]}: "
            "TRITON_INTERPRET must have the same value at triton's first import (torch and "
            "transformers import it) as when trainer.kernels.triton_ce is imported"
        )
    return kernels


INTERPRETED: bool = _built_for_interpreter()
"""True when the kernels were built for Triton's CPU interpreter (TRITON_INTERPRET=1 at import)."""


@dataclass(frozen=True)
class TileConfig:
    """Tile sizes and launch options; every block dim is >= 16 because tl.dot requires it."""

    block_n: int
    block_v: int
    block_d: int
    num_warps: int
    num_stages: int


def default_tiles(dtype: torch.dtype) -> TileConfig:
    """GPU tiles are the usual GEMM shapes; interpreter tiles are small so tests hit ragged edges."""
    if INTERPRETED:
        return TileConfig(block_n=16, block_v=128, block_d=16, num_warps=1, num_stages=1)
    if dtype == torch.float32:
        return TileConfig(block_n=64, block_v=64, block_d=32, num_warps=4, num_stages=3)
    return TileConfig(block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3)


def _precision(dtype: torch.dtype) -> str:
    # fp32 inputs must not silently drop to TF32 (10-bit mantissa); bf16/fp16 dots are exact anyway.
    return "ieee" if dtype == torch.float32 else "tf32"


def _default_splits(n_blocks: int, vocab_tiles: int, device: torch.device) -> int:
    """Enough vocabulary splits for ~2 programs per SM; 2 in the interpreter to exercise merging."""
    if device.type != "cuda":
        return min(2, vocab_tiles)
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(vocab_tiles, -(-2 * sms // n_blocks)))  # ceil division (triton.cdiv)


def triton_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    tiles: TileConfig,
    num_splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log-sum-exp [N], label logit [N], argmax [N] int64) from the fused forward kernel."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    n_blocks = triton.cdiv(n, tiles.block_n)
    vocab_tiles = triton.cdiv(vocab, tiles.block_v)
    splits = num_splits or _default_splits(n_blocks, vocab_tiles, hidden.device)
    v_per_split = triton.cdiv(vocab_tiles, min(splits, vocab_tiles)) * tiles.block_v
    splits = triton.cdiv(vocab, v_per_split)  # no empty split
    part = torch.empty((4, splits, n), dtype=torch.float32, device=hidden.device)
    best_idx = torch.empty((splits, n), dtype=torch.int32, device=hidden.device)
    _forward_kernel[(n_blocks, splits)](
        hidden, weight, labels, part[0], part[1], part[2], part[3], best_idx,
        n, vocab, d, v_per_split,
        hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1),
        BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_D=tiles.block_d,
        PRECISION=_precision(hidden.dtype), num_warps=tiles.num_warps, num_stages=tiles.num_stages,
    )  # fmt: skip
    run_max, run_sum, label_part, best = part[0], part[1], part[2], part[3]
    top = run_max.max(dim=0).values
    lse = top + torch.log((run_sum * torch.exp(run_max - top)).sum(dim=0))
    best_all = best.max(dim=0).values
    # Splits cover disjoint, increasing id ranges: the lowest id among the best splits wins ties.
    sentinel = torch.full_like(best_idx, vocab)
    argmax = torch.where(best == best_all, best_idx, sentinel).min(dim=0).values.long()
    return lse, label_part.sum(dim=0), argmax


def triton_grad_hidden(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    lse: torch.Tensor,
    grad_rows: torch.Tensor,
    tiles: TileConfig,
    chunk: int | None = None,
) -> torch.Tensor:
    """grad_hidden in fp32: per vocabulary chunk, kernel-made dlogits @ W_chunk."""
    n, d = hidden.shape
    vocab = weight.shape[0]
    if chunk is None:
        chunk = min(MAX_DLOGITS_CHUNK, DLOGITS_CHUNK_BYTES // (hidden.element_size() * n))
    chunk = min(max(tiles.block_v, chunk // tiles.block_v * tiles.block_v), vocab)
    grad = torch.zeros((n, d), dtype=torch.float32, device=hidden.device)
    buf = torch.empty((n, chunk), dtype=hidden.dtype, device=hidden.device)
    for v_start in range(0, vocab, chunk):
        width = min(chunk, vocab - v_start)
        grid = (triton.cdiv(n, tiles.block_n), triton.cdiv(width, tiles.block_v))
        _dlogits_kernel[grid](
            hidden, weight, labels, lse, grad_rows, buf,
            n, d, v_start, width,
            hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1), buf.stride(0),
            BLOCK_N=tiles.block_n, BLOCK_V=tiles.block_v, BLOCK_D=tiles.block_d,
            PRECISION=_precision(hidden.dtype), num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )  # fmt: skip
        dlogits = buf[:, :width]
        w = weight[v_start : v_start + width]
        add_chunk_grad(grad, dlogits, w)
    return grad


class _TritonContext(CEContext, Protocol):
    tiles: TileConfig
    chunk: int | None


class TritonLMHeadCE(torch.autograd.Function):
    """Autograd wrapper over the Triton kernels; saves the log-sum-exp, never the logits."""

    @staticmethod
    def forward(
        ctx: _TritonContext,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        ignore_index: int,
        tiles: TileConfig,
        num_splits: int | None,
        chunk: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        labels = labels.contiguous()
        stats = triton_forward(hidden, weight, labels, tiles, num_splits)
        ctx.tiles, ctx.chunk = tiles, chunk
        return ce_forward_epilogue(ctx, hidden, weight, labels, ignore_index, stats)

    @staticmethod
    @once_differentiable
    def backward(
        ctx: _TritonContext, grad_loss: torch.Tensor | None, _grad_correct: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, None, None, None, None, None, None]:
        saved = ce_backward_inputs(ctx, grad_loss)
        if saved is None:
            return None, None, None, None, None, None, None
        h, w, labels, lse, grad_rows = saved
        with _on_device(h.device):  # autograd may run backward on another thread/device
            grad = triton_grad_hidden(h, w, labels, lse, grad_rows, ctx.tiles, ctx.chunk)
        return grad.to(h.dtype), None, None, None, None, None, None


def triton_lm_head_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    ignore_index: int,
    *,
    tiles: TileConfig | None = None,
    num_splits: int | None = None,
    chunk: int | None = None,
) -> LMHeadCE:
    """Validated inputs in, LMHeadCE out; tiles/splits/chunk are exposed for tests and tuning."""
    tiles = tiles or default_tiles(hidden.dtype)
    with _on_device(hidden.device):
        # torch's Function.apply is unannotated; the types are forward's.
        loss, correct = TritonLMHeadCE.apply(  # type: ignore[no-untyped-call]
            hidden, weight, labels, ignore_index, tiles, num_splits, chunk
        )
    return LMHeadCE(loss=loss, correct=correct)


def _on_device(device: torch.device) -> AbstractContextManager[object]:
    """Triton launches on the current CUDA device; make it the tensors' device (cuda:1, ...)."""
    return torch.cuda.device(device) if device.type == "cuda" else nullcontext()
