"""collate_batch on packed batches: documents end to end, positions restarting per document."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from trainer.data.store import StoreWriter, TokenStore
from trainer.pipeline.collate import collate_batch
from trainer.sampler import Batch, BatchSampler

ROWS = [
    ([5, 6, 7, 8], [0, 0, 1, 1]),
    ([1, 2, 3], [0, 1, 1]),
    ([9, 9, 9, 9, 9, 9], [0, 1, 1, 1, 1, 0]),
    ([4], [1]),
]


def store(tmp_path: Path) -> TokenStore:
    with StoreWriter(tmp_path / "s") as writer:
        for tokens, mask in ROWS:
            writer.add(tokens, mask)
        writer.commit(
            kind="synthetic",
            source="unit test",
            vocab_size=16,
            max_length=8,
            mask_strategy="given",
        )
    return TokenStore.open(tmp_path / "s")


def test_packed_rows_lay_documents_end_to_end(tmp_path: Path) -> None:
    """Row 0 = docs 1, 3, 0 (3 + 1 + 4 = 8 tokens, full); row 1 = doc 2 (6 tokens, 2 padding)."""
    s = store(tmp_path)
    batch = Batch(np.array([1, 3, 0, 2]), 0, 8, 14, np.array([3, 1]))
    host = collate_batch(s, 7, batch, pin=False)
    assert host.seq == 7 and host.real_tokens == 14 == batch.real_tokens
    assert host.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 8], [9, 9, 9, 9, 9, 9, 0, 0]]
    assert host.loss_mask.tolist() == [[0, 1, 1, 1, 0, 0, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0]]
    assert host.attention_mask.tolist() == [[1] * 8, [1] * 6 + [0, 0]]
    assert host.position_ids is not None
    assert host.position_ids.tolist() == [[0, 1, 2, 0, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 0, 1]]
    assert host.input_ids.dtype == torch.int64 and host.position_ids.dtype == torch.int64
    assert host.input_ids.shape[1] == batch.max_len
    assert int(host.attention_mask.sum()) == batch.real_tokens
    assert host.input_ids.numel() == batch.padded_tokens


def test_the_sampler_s_packed_batches_collate_truthfully(tmp_path: Path) -> None:
    """For every packed batch of an epoch: width = max_len, real tokens = the attention mask's
    ones, padded tokens = the tensor's size, and each document's tokens sit where its row puts
    them with positions 0..n-1; the unpacked strategies still collate one sample a row."""
    s = store(tmp_path)
    sampler = BatchSampler(s.lengths, strategy="packed", token_budget=16, max_batch=3, seed=1)
    for batch in sampler.epoch_batches(0):
        host = collate_batch(s, 0, batch, pin=False)
        assert host.position_ids is not None
        assert host.input_ids.shape == (batch.num_rows, batch.max_len)
        assert int(host.attention_mask.sum()) == batch.real_tokens == host.real_tokens
        for r, ids in enumerate(batch.rows()):
            at = 0
            for i in ids.tolist():
                tokens, mask = s.row(i)
                n = len(tokens)
                assert host.input_ids[r, at : at + n].tolist() == tokens.tolist()
                assert host.loss_mask[r, at : at + n].tolist() == mask.tolist()
                assert host.position_ids[r, at : at + n].tolist() == list(range(n))
                at += n
    plain = BatchSampler(s.lengths, strategy="random", token_budget=16, max_batch=3, seed=1)
    for batch in plain.epoch_batches(0):
        host = collate_batch(s, 0, batch, pin=False)
        assert host.position_ids is None and host.input_ids.shape[0] == len(batch.indices)
