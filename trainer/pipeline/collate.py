"""Micro-batches from the store: sample ids -> right-padded host tensors (`HostBatch`).

`collate` pads one sample per row (every strategy but "packed"); `collate_packed` lays each row's
documents end to end (the sampler's `Batch.rows()`), padded only after the row's last document,
with `position_ids` restarting at 0 at each document, which is all the target (block-diagonal
causal attention) and the drafter (per-document anchors, context and RoPE) need to keep the
documents apart. The padding tail of a row counts as one more document (positions 0..k-1,
attention_mask 0, loss_mask 0). `collate_batch` is what the prefetch workers call.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trainer.data.store import TokenStore
from trainer.sampler import Batch


@dataclass
class HostBatch:
    """One collated micro-batch, right-padded, on the host (pinned when feeding a GPU)."""

    seq: int
    input_ids: Tensor  # [B, L] int64
    loss_mask: Tensor  # [B, L] uint8
    attention_mask: Tensor  # [B, L] int64
    real_tokens: int
    # [B, L] int64 positions relative to each position's document (packed rows: several
    # documents per row, each starting at 0); None: one document per row, positions 0..L-1
    position_ids: Tensor | None = None


def collate(store: TokenStore, seq: int, indices: np.ndarray, pin: bool) -> HostBatch:
    """One sample per row, right-padded to the longest."""
    tokens, mask, lengths = store.gather(indices)
    input_ids = torch.from_numpy(tokens.astype(np.int64))
    loss_mask = torch.from_numpy(mask)
    width = tokens.shape[1]
    attention = (torch.arange(width)[None, :] < torch.from_numpy(lengths)[:, None]).long()
    if pin:
        input_ids, loss_mask, attention = (
            t.pin_memory() for t in (input_ids, loss_mask, attention)
        )
    return HostBatch(seq, input_ids, loss_mask, attention, int(lengths.sum()))


def collate_packed(store: TokenStore, seq: int, rows: list[np.ndarray], pin: bool) -> HostBatch:
    """Several documents per row (`rows[r]`: their ids, in order), padded to the fullest row."""
    lengths = [store.lengths[r].astype(np.int64) for r in rows]
    fills = [int(x.sum()) for x in lengths]
    width = max(fills)
    tokens = np.zeros((len(rows), width), dtype=np.int64)
    mask = np.zeros((len(rows), width), dtype=np.uint8)
    positions = np.zeros((len(rows), width), dtype=np.int64)
    for r, (ids, lens) in enumerate(zip(rows, lengths, strict=True)):
        at = 0
        for lo, n in zip(store.offsets[ids].tolist(), lens.tolist(), strict=True):
            tokens[r, at : at + n] = store.tokens[lo : lo + n]
            mask[r, at : at + n] = store.mask[lo : lo + n]
            positions[r, at : at + n] = np.arange(n)
            at += n
        positions[r, at:] = np.arange(width - at)  # the padding tail: one more "document"
    input_ids, loss_mask = torch.from_numpy(tokens), torch.from_numpy(mask)
    position_ids = torch.from_numpy(positions)
    attention = (torch.arange(width)[None, :] < torch.tensor(fills)[:, None]).long()
    if pin:
        input_ids, loss_mask, attention, position_ids = (
            t.pin_memory() for t in (input_ids, loss_mask, attention, position_ids)
        )
    return HostBatch(seq, input_ids, loss_mask, attention, sum(fills), position_ids)


def collate_batch(store: TokenStore, seq: int, batch: Batch, pin: bool) -> HostBatch:
    """The sampler's batch `seq` as host tensors (packed rows when the batch has them)."""
    if batch.row_sizes is not None:
        return collate_packed(store, seq, batch.rows(), pin)
    return collate(store, seq, batch.indices, pin)
