"""Bytes of one drafter forward+backward, derived from the drafter's shapes (no torch).

Activations saved for backward are counted op by op as `trainer.model.drafter` runs them (one
entry per tensor autograd keeps alive, shared tensors once), per query row (a block token), per
context token, and per valid prediction (the CE input). The peak is the end of the forward plus
the largest transient of the start of the backward (the chunked CE's fp32 gradient and one
vocabulary tile), when nothing has been freed yet. `c` is the compute dtype's size (2 under bf16
autocast, 4 in fp32); RMSNorm always keeps two fp32 copies of its input (x and x * rsqrt).

The attention backend decides the mask cost: flex (CUDA) keeps a BlockMask, built
analytically from the anchors (`trainer.model.masks.flex_dflash_block_mask`, no dense mask at
any point): int32 tile lists, 16 bytes per (128-row Q tile, 128-key KV tile) pair, plus the
anchors, starts and valid mask its mask_mod reads (`flex_block_mask_bytes`; ~0.2 MiB for a
24,576-row piece). SDPA takes a dense bool [R, 1, Q, S+Q] mask, and the CPU kernel converts it
to a float mask per layer, which it keeps for backward (quadratic in the row's width: the
reason real widths use flex). Validated on CPU against the allocator profiler
(benchmarks/bench_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, TypeAlias

import numpy as np
import numpy.typing as npt

from trainer.memory.shapes import DrafterShape, TargetShape
from trainer.model.key_widths import KEY_MULTIPLE

Backend = Literal["flex", "sdpa"]
Ints: TypeAlias = "npt.NDArray[np.int64]"
"""Integers per piece or per batch shape (`activation_peaks`, `batches.ShapeTable`)."""
GiB = 2**30
CE_CHUNK_BYTES = 256 * 2**20  # trainer.kernels.chunked.DEFAULT_CHUNK_BYTES
CE_MAX_CHUNK = 16384  # trainer.kernels.chunked.MAX_CHUNK
FLEX_TILE = 128  # trainer.model.masks.TILE: the BlockMask tile (query rows and keys)


def per_query_row_layer(d: DrafterShape, c: int, backend: Backend = "flex") -> int:
    """Bytes one block token keeps alive in one drafter layer.

    RoPE keeps nothing per row (cos/sin need no grad, so x * cos saves only cos). CPU SDPA
    returns its output in [B, Q, H, D] memory, so o_proj's input is a view; flex's output is
    counted as copied (conservative: not measured here).
    """
    h, q, kv = d.hidden, d.q_width, d.kv_width
    norms = 2 * 8 * h  # input and post-attention RMSNorm: fp32 x and x * rsqrt
    linear_in = 2 * c * h  # q/k/v_proj input (one tensor) and the MLP input
    q_path = 8 * q + c * q  # q_norm (fp32 x2), the rotated q kept by attention
    k_blk = 8 * kv  # k_norm (fp32 x2)
    kv_cat = 2 * c * kv  # [context; block] K and V, kept by attention
    o_copy = c * q if backend == "flex" else 0
    attn = c * q + 4 * d.heads + o_copy  # output, log-sum-exp (fp32 per head), o_proj input
    mlp = 4 * c * d.intermediate  # gate, silu(gate), up, product
    return norms + linear_in + q_path + k_blk + kv_cat + attn + mlp


def per_context_token_layer(d: DrafterShape, c: int) -> int:
    """Bytes one context position keeps alive in one layer (its K/V path)."""
    return per_projected_token_layer(d) + per_attended_token_layer(d, c)


def per_projected_token_layer(d: DrafterShape) -> int:
    """Of those, the bytes where the context is projected: k_norm (fp32 x2)."""
    return 8 * d.kv_width


def per_attended_token_layer(d: DrafterShape, c: int) -> int:
    """Of those, the bytes where the context is attended: K and V in the [context; block] cat."""
    return 2 * c * d.kv_width


def per_context_token_shared(d: DrafterShape, c: int, feature_bytes: int) -> int:
    """Bytes per context position kept once for all layers: fc input cast, hidden_norm, output.

    Under autocast the fc input is a c-byte copy of the features (after project_context's fp32
    cast, freed at once); in fp32 the features themselves are fc's input (no new bytes).
    """
    h = d.hidden
    fc_in = c * d.features * h if (c != 4 or feature_bytes != 4) else 0
    return fc_in + 8 * h + c * h  # hidden_norm (fp32 x2), the context (k/v_proj input)


def per_query_row_shared(d: DrafterShape, c: int) -> int:
    """Per block token outside the layers: ids, embedding output, final norm, the CE input."""
    h = d.hidden
    valid = (d.block - 1) / d.block  # slots 1..B-1 are scored; slot 0 (the anchor) never is
    final_norm = 8 * h  # fp32 x2 (its output is only indexed: [valid] keeps the indices)
    ce = valid * (c * h + 8 + 4 + 4)  # out[valid] copy, its index, lse, label
    return int(8 + final_norm + ce)


def ce_chunk(n_rows: Ints, vocab: int) -> Ints:
    """The chunked CE's vocabulary tile for `n_rows` valid predictions (each, for an array)."""
    width = CE_CHUNK_BYTES // (4 * np.maximum(n_rows, 1))
    chunk: Ints = np.minimum(np.minimum(CE_MAX_CHUNK, np.maximum(256, width // 256 * 256)), vocab)
    return chunk


def ce_backward_transient(d: DrafterShape, n_valid: Ints, c: int) -> Ints:
    """The chunked CE backward: fp32 grad_hidden, one fp32 tile, bf16 copies under autocast."""
    ch = ce_chunk(n_valid, d.vocab)
    extra = (2 * n_valid * ch + 2 * n_valid * d.hidden) if c != 4 else 0
    return 4 * n_valid * d.hidden + 4 * n_valid * ch + extra


@dataclass(frozen=True)
class Piece:
    """One micro-step: `rows` sequences of `seq` positions, `width` anchors each (padded).

    `packed_tokens`: the rows are documents unpacked from packed rows, whose context the
    drafter projects on those packed rows and gathers per layer (`trainer.model.documents`):
    the packed positions projected (at most the packet's); 0 = projected in the rows' layout.
    """

    rows: int
    seq: int
    width: int
    packed_tokens: int = 0

    def query_rows(self, block: int) -> int:
        return self.rows * self.width * block


def flex_block_mask_bytes(piece: Piece, block: int, tile: int = FLEX_TILE) -> int:
    """Bytes of the flex BlockMask one piece keeps through forward and backward.

    kv and q sides, partial and full: 4 int32 index lists of [R, nQ, nKV] (or transposed) and 4
    count vectors; the mask_mod's captured anchors and context starts (int64 [R, N]) and valid
    mask (bool [R, S]). The build's transients (O(R * N * nKV)) are freed before the forward.
    """
    rows, seq, width = (np.asarray(v, dtype=np.int64) for v in (piece.rows, piece.seq, piece.width))
    return int(_flex_block_mask_bytes(rows, seq, width, block, tile))


def _flex_block_mask_bytes(rows: Ints, seq: Ints, width: Ints, block: int, tile: int) -> Ints:
    q_len = width * block
    n_q, n_kv = -(-q_len // tile), -(-(seq + q_len) // tile)
    tiles = 4 * 4 * n_q * n_kv + 2 * 4 * (n_q + n_kv)
    out: Ints = rows * (tiles + 2 * 8 * width + seq)
    return out


def activation_peak(
    d: DrafterShape, piece: Piece, *, c: int = 2, feature_bytes: int = 2, backend: Backend = "flex"
) -> int:
    """Peak bytes of one piece's forward+backward above the weights, grads and optimizer."""
    dims = (piece.rows, piece.seq, piece.width, piece.packed_tokens)
    one = (np.asarray(v, dtype=np.int64) for v in dims)  # 0-d arrays: one piece
    return int(activation_peaks(d, *one, c=c, feature_bytes=feature_bytes, backend=backend))


def activation_peaks(
    d: DrafterShape,
    rows: Ints,
    seq: Ints,
    width: Ints,
    packed_tokens: Ints,
    *,
    c: int = 2,
    feature_bytes: int = 2,
    backend: Backend = "flex",
) -> Ints:
    """`activation_peak` of many pieces at once: (rows, seq, width, packed_tokens) are int64
    arrays of one length (0-d for one piece); the estimate prices every shape's pieces so."""
    qr = rows * width * d.block
    tokens = rows * seq
    projected = np.where(packed_tokens > 0, packed_tokens, tokens)  # where fc, k/v_proj run
    saved = qr * (d.layers * per_query_row_layer(d, c, backend) + per_query_row_shared(d, c))
    saved += d.layers * (
        projected * per_projected_token_layer(d) + tokens * per_attended_token_layer(d, c)
    )
    saved += projected * per_context_token_shared(d, c, feature_bytes)
    # project_context's fp32 cast of the features, alive while fc's input is made from it
    cast = 4 * d.features * d.hidden * projected if feature_bytes != 4 else 0
    if backend == "flex":
        saved += _flex_block_mask_bytes(rows, seq, width, d.block, FLEX_TILE)
    if backend == "sdpa":
        kv_len = -(-(seq + width * d.block) // KEY_MULTIPLE) * KEY_MULTIPLE
        saved += qr * kv_len  # the bool mask
        saved += d.layers * c * qr * kv_len  # CPU SDPA's float mask (compute dtype), per layer
    n_valid = (qr * (d.block - 1) / d.block).astype(np.int64)  # floor: both are >= 0
    # The last layer's down_proj weight gradient, made before it is added into .grad (bf16 under
    # autocast, then its fp32 cast), while nearly every activation is still saved.
    wgrad = (4 + (2 if c != 4 else 0)) * d.hidden * d.intermediate
    transient = np.maximum(np.maximum(ce_backward_transient(d, n_valid, c), cast), wgrad)
    return saved + transient


@dataclass(frozen=True)
class Fixed:
    """Drafter device bytes that do not depend on the batch."""

    master: int
    grads: int
    adam: int
    autocast_cache: int
    borrowed: int

    @property
    def total(self) -> int:
        return self.master + self.grads + self.adam + self.autocast_cache + self.borrowed


def drafter_fixed(d: DrafterShape, target: TargetShape, *, target_bytes: int, c: int) -> Fixed:
    """fp32 master weights, fp32 grads, AdamW's two fp32 moments, autocast's weight copies,
    and the target's embedding and LM head (borrowed, in the target dtype; one if tied)."""
    p = d.params
    heads = 1 if target.tied else 2
    return Fixed(
        master=4 * p,
        grads=4 * p,
        adam=8 * p,
        autocast_cache=c * d.linear_params if c != 4 else 0,
        borrowed=heads * target.vocab * target.hidden * target_bytes,
    )


def target_peak(t: TargetShape, tokens: int, features: int, *, dtype_bytes: int) -> dict[str, int]:
    """A target device: weights, the captured features of one batch, one layer's working set.

    Capture runs under no_grad and stops at the deepest captured layer, so only one layer's
    activations are alive (hidden, q/k/v, attention output, the SwiGLU intermediates). Not
    validated against a measurement (no GPU here); the drafter's side is.
    """
    h, q, kv = t.hidden, t.heads * t.head_dim, t.kv_heads * t.head_dim
    layer = tokens * dtype_bytes * (3 * h + q * 2 + 2 * kv + 3 * t.intermediate)
    return {
        "target_weights": t.params * dtype_bytes,
        "captured_features": tokens * features * h * dtype_bytes,
        "layer_working_set": layer,
    }
