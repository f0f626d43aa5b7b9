"""Micro-batches from the store: sample ids -> right-padded host tensors (`HostBatch`).

`collate` pads one sample per row (every strategy but "packed"); `collate_batch` is what the
prefetch workers call with the sampler's `Batch`, so a strategy that lays several documents into
one row (packing) changes only this module and the sampler.
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


def collate_batch(store: TokenStore, seq: int, batch: Batch, pin: bool) -> HostBatch:
    """The sampler's batch `seq` as host tensors."""
    return collate(store, seq, batch.indices, pin)
