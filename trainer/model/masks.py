"""Anchor sampling and the DFlash training attention mask.

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
) -> Anchors:
    """Draw up to `num_anchors` distinct eligible anchors per row, uniformly, then sort them.

    The batch width is min(num_anchors, max eligible count); rows with fewer eligible
    positions are padded with keep=False. Runs on the CPU (the generator is a CPU generator,
    so the draw is identical on every device); the result is on the CPU.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1, got {num_anchors}")
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


def flex_dflash_block_mask(
    anchors: Tensor,
    context_valid: Tensor,
    block_size: int,
    context_start: Tensor | None = None,
) -> BlockMask:
    """The same mask as a flex_attention BlockMask (H=None: no per-head materialisation)."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows, n = anchors.shape
    seq = context_valid.shape[1]
    q_len, kv_len = n * block_size, seq + n * block_size
    valid = context_valid.bool()
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

    return create_block_mask(
        mask_mod, B=rows, H=None, Q_LEN=q_len, KV_LEN=kv_len, device=anchors.device
    )
