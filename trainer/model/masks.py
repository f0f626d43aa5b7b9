"""Anchor sampling (per document on packed rows) and the DFlash training attention mask.

Layout of one training forward for a row with S context positions and N blocks of size B:
queries are the N*B block tokens; keys are [S context positions | N*B block tokens]. Query
slot k of block n (anchor a_n, context start c_n) may see
  * context key j  iff  c_n <= j < a_n and j is a real (non-padded) position — the anchor's
    own hidden state does not exist yet at inference time; c_n is 0 for an unpacked row and
    the start of the anchor's document in a packed row (`context_start`, None = all 0);
  * block key i    iff  i belongs to block n (bidirectional inside the block).
Padded blocks (keep=False) keep their in-block visibility, so no query row is ever fully
masked (a fully masked row is NaN in softmax, and 0 * NaN poisons the loss).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:  # flex_attention is imported only where a flex mask is built
    from torch.nn.attention.flex_attention import BlockMask


@dataclass(frozen=True)
class Anchors:
    """Per-row block anchors, ascending, padded at the end with keep=False."""

    positions: Tensor  # [B, N] int64 anchor positions (0 for padding)
    keep: Tensor  # [B, N] bool, False for padding blocks

    @property
    def num_blocks(self) -> int:
        return int(self.positions.shape[1])


def eligible_anchors(loss_mask: Tensor, attention_mask: Tensor | None = None) -> Tensor:
    """Positions a that can anchor a block: supervised, with a supervised next token.

    Tail anchors (fewer than B-1 positions left) are allowed; their out-of-range labels are
    masked. Returns a bool [B, S].
    """
    lm = loss_mask.bool()
    if attention_mask is not None:
        lm = lm & attention_mask.bool()
    out = torch.zeros_like(lm)
    out[:, :-1] = lm[:, :-1] & lm[:, 1:]
    return out


def sample_anchors(
    loss_mask: Tensor,
    attention_mask: Tensor | None,
    num_anchors: int,
    generator: torch.Generator | None = None,
    position_ids: Tensor | None = None,
) -> Anchors:
    """Draw up to `num_anchors` distinct eligible anchors per row, uniformly, then sort them.

    The batch width is min(num_anchors, max eligible count); rows with fewer eligible
    positions are padded with keep=False. Runs on the CPU (the generator is a CPU generator,
    so the draw is identical on every device); the result is on the CPU.

    Packed rows (`position_ids`, restarting at 0 at each document): the same rule per
    DOCUMENT (a new one wherever the position is 0; eligibility from `document_eligible`): up
    to `num_anchors` of each document's eligible positions, uniformly, so a document gets the
    anchors it would get alone in a row. One draw of [R, S] keys from the CPU generator either
    way; the width is the most any row holds.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
    if position_ids is not None:
        return _sample_document_anchors(
            loss_mask, attention_mask, num_anchors, generator, position_ids
        )
    eligible = eligible_anchors(
        loss_mask.cpu(), None if attention_mask is None else attention_mask.cpu()
    )
    rows, seq = eligible.shape
    width = min(num_anchors, int(eligible.sum(1).max()) if rows else 0)
    if width == 0:
        empty = torch.zeros(rows, 0, dtype=torch.long)
        return Anchors(empty, empty.bool())
    # dtype explicit: the process default is global state another thread may change.
    keys = torch.rand(rows, seq, generator=generator, dtype=torch.float32)
    keys = keys.masked_fill(~eligible, 2.0)
    picked_keys, picked = keys.topk(width, dim=1, largest=False)
    keep = picked_keys < 2.0
    # Sort ascending by position with padding last: padded entries get a key past any position.
    order_key = torch.where(keep, picked, torch.full_like(picked, seq))
    order_key, order = order_key.sort(dim=1)
    keep = keep.gather(1, order)
    positions = torch.where(keep, order_key, torch.zeros_like(order_key))
    return Anchors(positions, keep)


def document_eligible(
    loss_mask: Tensor, attention_mask: Tensor | None, position_ids: Tensor
) -> Tensor:
    """`eligible_anchors` for packed rows: also the next token must be the same
    document's (position + 1), so no anchor pair crosses a document boundary. Bool [R, S]."""
    out = eligible_anchors(loss_mask, attention_mask)
    pos = position_ids.to(out.device)
    out[:, :-1] &= pos[:, 1:] == pos[:, :-1] + 1
    return out


def _sample_document_anchors(
    loss_mask: Tensor,
    attention_mask: Tensor | None,
    num_anchors: int,
    generator: torch.Generator | None,
    position_ids: Tensor,
) -> Anchors:
    """`sample_anchors` on packed rows (see there)."""
    pos = position_ids.cpu()
    attn = None if attention_mask is None else attention_mask.cpu()
    eligible = document_eligible(loss_mask.cpu(), attn, pos)
    rows, seq = eligible.shape
    if rows == 0 or not bool(eligible.any()):
        empty = torch.zeros(rows, 0, dtype=torch.long)
        return Anchors(empty, empty.bool())
    # dtype explicit: the process default is global state another thread may change.
    keys = torch.rand(rows, seq, generator=generator, dtype=torch.float32)
    keys = keys.masked_fill(~eligible, 2.0)
    doc = (pos == 0).cumsum(1)  # [R, S] document number in its row
    # Sort by (document, key): keys lie in [0, 1) or are 2.0, so doc * 4 + key orders both.
    _, order = (doc.double() * 4 + keys.double()).sort(dim=1, stable=True)
    sorted_doc = doc.gather(1, order)
    idx = torch.arange(seq).expand(rows, seq)
    first = torch.ones_like(eligible)
    first[:, 1:] = sorted_doc[:, 1:] != sorted_doc[:, :-1]
    rank = idx - torch.where(first, idx, torch.zeros_like(idx)).cummax(1).values
    chosen = torch.zeros_like(eligible)
    chosen.scatter_(1, order, (rank < num_anchors) & eligible.gather(1, order))
    width = int(chosen.sum(1).max())
    at = torch.where(chosen, idx, torch.full_like(idx, seq)).sort(dim=1).values[:, :width]
    keep = at < seq
    return Anchors(torch.where(keep, at, torch.zeros_like(at)), keep)


def dense_dflash_mask(
    anchors: Tensor,
    context_valid: Tensor,
    block_size: int,
    context_start: Tensor | None = None,
) -> Tensor:
    """Boolean SDPA mask [B, 1, N*B, S + N*B] (True = may attend), see the module docstring.

    `context_start` [B, N] int64: the first context position block n of row r may see
    (packed rows: the start of the anchor's document); None = 0.
    """
    rows, n = anchors.shape
    seq = context_valid.shape[1]
    q = n * block_size
    device = anchors.device
    q_block = torch.arange(q, device=device) // block_size  # [Q]
    q_anchor = anchors.gather(1, q_block.expand(rows, q))  # [B, Q]
    ctx = torch.arange(seq, device=device)
    ctx_vis = (ctx[None, None, :] < q_anchor[:, :, None]) & context_valid.bool()[:, None, :]
    if context_start is not None:
        q_start = context_start.to(device).gather(1, q_block.expand(rows, q))  # [B, Q]
        ctx_vis &= ctx[None, None, :] >= q_start[:, :, None]
    blk_vis = (q_block[:, None] == q_block[None, :]).expand(rows, q, q)
    return torch.cat([ctx_vis, blk_vis], dim=2)[:, None]


MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]
TILE = 128  # flex_attention's default sparse block size (Q and KV tile)


def _dflash_mask_mod(
    anchors: Tensor, context_valid: Tensor, block_size: int, context_start: Tensor | None
) -> MaskMod:
    """The element-wise DFlash mask as a flex mask_mod (evaluated on partial tiles only)."""
    seq = context_valid.shape[1]
    valid = context_valid.bool().to(anchors.device)
    start = torch.zeros_like(anchors) if context_start is None else context_start.to(anchors.device)

    def mask_mod(b: Tensor, _h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_block = q_idx // block_size
        anchor = anchors[b, q_block]
        in_ctx = kv_idx < seq
        ctx_ok = (
            in_ctx
            & (kv_idx < anchor)
            & (kv_idx >= start[b, q_block])
            & valid[b, kv_idx.clamp(max=seq - 1)]
        )
        blk_ok = (~in_ctx) & ((kv_idx - seq).clamp(min=0) // block_size == q_block)
        return ctx_ok | blk_ok

    return mask_mod


def dflash_tiles(
    anchors: Tensor,
    context_valid: Tensor,
    block_size: int,
    context_start: Tensor | None = None,
    tile: tuple[int, int] = (TILE, TILE),
) -> tuple[Tensor, Tensor]:
    """Which (Q tile, KV tile) pairs of the DFlash mask are partial and which are full.

    Returns two bool [R, nQ, nKV] tensors (disjoint): `partial` = some but not all elements
    visible, `full` = every element visible (flex skips the mask_mod there). Tiles that reach
    past Q_LEN or KV_LEN are never full (as in `create_block_mask`, which pads with False).

    Computed from the structure, not from elements. Block n (anchor a, start c) sees the real
    positions of its context interval [c, a) and its own block's keys; a Q tile holds the
    <= ceil(TQ/B)+1 blocks its rows belong to, and a tile pair is visible somewhere iff one of
    them sees into the KV tile, everywhere iff all of them see all of it. Context, "full": the
    tile's context part lies inside every interval (max c <= its start, min a >= its end) and
    is all real. Context, "any": an interval covers the KV tiles strictly between its first and
    last (each visible iff it holds a real position; a difference array over KV tiles), and its
    two end tiles are checked exactly with prefix sums of the valid mask. Block keys depend on
    no row. Memory and work O(R * nQ * nKV + R * N), no host sync.
    """
    tq, tk = tile
    rows, n = anchors.shape
    seq = context_valid.shape[1]
    q_len, kv_len = n * block_size, seq + n * block_size
    n_q, n_kv = -(-q_len // tq), -(-kv_len // tk)
    dev = anchors.device
    if n == 0:
        empty = torch.zeros(rows, 0, n_kv, dtype=torch.bool, device=dev)
        return empty, empty
    a = anchors.long()  # [R, N]
    c = torch.zeros_like(a) if context_start is None else context_start.to(dev).long()
    zero = torch.zeros(rows, 1, dtype=torch.long, device=dev)
    prefix = torch.cat([zero, context_valid.to(dev).long().cumsum(1)], 1)  # [R, S+1]

    k0 = torch.arange(n_kv, device=dev) * tk  # [K] KV tile starts
    k1 = (k0 + tk).clamp(max=kv_len)  # [K] ends (exclusive)
    ctx_lo, ctx_hi = k0.clamp(max=seq), k1.clamp(max=seq)  # the tile's context part
    ctx_width = ctx_hi - ctx_lo
    tile_real = prefix[:, ctx_hi] - prefix[:, ctx_lo]  # [R, K] real positions in that part

    # Q tile m holds query rows [m*TQ, min((m+1)*TQ, Q)), i.e. blocks first[m]..last[m].
    q0 = torch.arange(n_q, device=dev) * tq
    first = q0 // block_size
    last = ((q0 + tq).clamp(max=q_len) - 1) // block_size
    span = -(-tq // block_size) + 1  # most blocks one Q tile can touch
    member_idx = first[:, None] + torch.arange(span, device=dev)[None, :]  # [M, J]
    member = member_idx <= last[:, None]
    flat_idx = member_idx.clamp(max=n - 1).flatten()

    def per_tile(x: Tensor) -> Tensor:
        """[R, N] per block -> [R, M, J] per (Q tile, member)."""
        return x[:, flat_idx].view(rows, n_q, span)

    mem = member[None]  # [1, M, J]

    # Context, full: every member's interval contains the tile's context part, all real.
    c_max = torch.where(mem, per_tile(c), torch.iinfo(torch.long).min).amax(2)  # [R, M]
    a_min = torch.where(mem, per_tile(a), torch.iinfo(torch.long).max).amin(2)
    ctx_full = (ctx_width == 0)[None, None, :] | (
        (c_max[:, :, None] <= ctx_lo[None, None, :])
        & (a_min[:, :, None] >= ctx_hi[None, None, :])
        & (tile_real == ctx_width[None, :])[:, None, :]
    )

    # Context, any: per block, interval [lo, hi) in context tiles kf..kl.
    lo = c.clamp(0, seq)
    hi = torch.maximum(a.clamp(max=seq), lo)
    nonempty = hi > lo
    kf, kl = lo // tk, (hi - 1).clamp(min=0) // tk
    real_first = prefix.gather(1, torch.minimum(hi, (kf + 1) * tk)) - prefix.gather(1, lo)
    real_last = prefix.gather(1, hi) - prefix.gather(1, torch.maximum(lo, kl * tk))
    interior = (per_tile(nonempty & (kl > kf + 1)) & mem).int()  # [R, M, J]
    kf_t, kl_t = per_tile(kf), per_tile(kl)
    cover = torch.zeros(rows, n_q, n_kv + 1, dtype=torch.int32, device=dev)
    cover.scatter_add_(2, kf_t + 1, interior)
    cover.scatter_add_(2, kl_t, -interior)
    inside = cover.cumsum(2)[:, :, :n_kv] > 0  # strictly between some member's end tiles
    edge = torch.zeros(rows, n_q, n_kv, dtype=torch.int32, device=dev)
    edge.scatter_add_(2, kf_t, (per_tile(nonempty & (real_first > 0)) & mem).int())
    edge.scatter_add_(2, kl_t, (per_tile(nonempty & (real_last > 0)) & mem).int())
    ctx_any = (inside & (tile_real > 0)[:, None, :]) | (edge > 0)

    # Own block: keys [S + nB, S + (n+1)B) against the tile's block part [max(k0, S), k1).
    blk_lo = seq + member_idx.clamp(max=n - 1)[:, :, None] * block_size  # [M, J, 1]
    blk_hi = blk_lo + block_size
    part_lo, part_hi = k0.clamp(min=seq), k1  # [K]
    blk_any = (torch.maximum(blk_lo, part_lo) < torch.minimum(blk_hi, part_hi)) & member[..., None]
    blk_full = (part_lo >= part_hi) | ((blk_lo <= part_lo) & (part_hi <= blk_hi))
    blk_full = blk_full | ~member[..., None]

    q_complete = (q0 + tq) <= q_len  # [M]
    kv_complete = (k1 - k0) == tk  # [K]
    any_tile = ctx_any | blk_any.any(1)[None]
    full_tile = (
        ctx_full & blk_full.all(1)[None] & q_complete[None, :, None] & kv_complete[None, None, :]
    )
    return any_tile & ~full_tile, full_tile


def _ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """[R, M, K] bool tiles as flex's (num_blocks [R, 1, M], indices [R, 1, M, K]) int32."""
    as_int = tiles.to(torch.int32)[:, None]
    num = as_int.sum(-1).to(torch.int32)
    idx = torch.argsort(as_int, dim=-1, descending=True, stable=True).to(torch.int32)
    return num.contiguous(), idx.contiguous()


def flex_dflash_block_mask(
    anchors: Tensor,
    context_valid: Tensor,
    block_size: int,
    context_start: Tensor | None = None,
    tile: int | tuple[int, int] = TILE,
) -> BlockMask:
    """The same mask as a flex_attention BlockMask (H=None: no per-head materialisation).

    Built analytically (`dflash_tiles`, then `BlockMask.from_kv_blocks`): never a dense
    [Q, KV] tensor; `reference_flex_block_mask` is the create_block_mask twin tests compare.
    """
    from torch.nn.attention.flex_attention import BlockMask

    tiles = (tile, tile) if isinstance(tile, int) else tile
    n = anchors.shape[1]
    seq = context_valid.shape[1]
    partial, full = dflash_tiles(anchors, context_valid, block_size, context_start, tiles)
    kv_num, kv_idx = _ordered(partial)
    full_num, full_idx = _ordered(full)
    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=tiles,
        mask_mod=_dflash_mask_mod(anchors, context_valid, block_size, context_start),
        seq_lengths=(n * block_size, seq + n * block_size),
    )


def reference_flex_block_mask(
    anchors: Tensor,
    context_valid: Tensor,
    block_size: int,
    context_start: Tensor | None = None,
    tile: int | tuple[int, int] = TILE,
) -> BlockMask:
    """The BlockMask via `create_block_mask` (materialises [R, 1, Q, KV]: tests and benchmarks
    only; the training path is `flex_dflash_block_mask`)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, n = anchors.shape
    seq = context_valid.shape[1]
    return create_block_mask(
        _dflash_mask_mod(anchors, context_valid, block_size, context_start),
        B=rows,
        H=None,
        Q_LEN=n * block_size,
        KV_LEN=seq + n * block_size,
        device=anchors.device,
        BLOCK_SIZE=tile,
    )
