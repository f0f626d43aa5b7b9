"""Anchors and the DFlash attention mask against loop references."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from trainer.model.masks import (
    dense_dflash_mask,
    eligible_anchors,
    flex_dflash_block_mask,
    sample_anchors,
)


def loop_mask(
    anchors: list[list[int]],
    context_valid: list[list[bool]],
    block: int,
    context_start: list[list[int]] | None = None,
) -> torch.Tensor:
    """O(Q * KV) Python reference of the DFlash training mask."""
    rows, n, seq = len(anchors), len(anchors[0]), len(context_valid[0])
    out = torch.zeros(rows, 1, n * block, seq + n * block, dtype=torch.bool)
    for b in range(rows):
        for q in range(n * block):
            qb = q // block
            start = 0 if context_start is None else context_start[b][qb]
            for kv in range(seq + n * block):
                if kv < seq:
                    out[b, 0, q, kv] = start <= kv < anchors[b][qb] and context_valid[b][kv]
                else:
                    out[b, 0, q, kv] = (kv - seq) // block == qb
    return out


@settings(max_examples=25, deadline=None)
@given(
    seq=st.integers(2, 12),
    n=st.integers(1, 4),
    block=st.integers(2, 5),
    data=st.data(),
)
def test_dense_mask_equals_loop_reference(
    seq: int, n: int, block: int, data: st.DataObject
) -> None:
    """Context strictly before the anchor and real; own block bidirectional; no empty row."""
    anchors = [[data.draw(st.integers(0, seq - 1)) for _ in range(n)] for _ in range(2)]
    valid = [[data.draw(st.booleans()) for _ in range(seq)] for _ in range(2)]
    got = dense_dflash_mask(torch.tensor(anchors), torch.tensor(valid), block)
    assert torch.equal(got, loop_mask(anchors, valid, block))
    assert got.any(-1).all(), "a fully masked query row would give NaN"


def test_flex_block_mask_matches_dense_mask() -> None:
    """The flex BlockMask encodes exactly the dense mask (checked element-wise)."""
    anchors = torch.tensor([[0, 3, 9], [2, 2, 0]])
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, 8:] = False
    block_mask = flex_dflash_block_mask(anchors, valid, 4)
    dense = dense_dflash_mask(anchors, valid, 4)
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(12), torch.arange(23), indexing="ij")
    via_mod = block_mask.mask_mod(b, torch.zeros_like(b), q, kv)
    assert torch.equal(via_mod, dense[:, 0])


@settings(max_examples=25, deadline=None)
@given(
    seq=st.integers(2, 12),
    n=st.integers(1, 4),
    block=st.integers(2, 5),
    data=st.data(),
)
def test_context_start_masks_context_before_each_blocks_document(
    seq: int, n: int, block: int, data: st.DataObject
) -> None:
    """Block n sees context j iff start[n] <= j < anchor[n] and j is real: the dense mask and
    the flex BlockMask's mask_mod both equal the loop reference."""
    anchors = [[data.draw(st.integers(0, seq - 1)) for _ in range(n)] for _ in range(2)]
    starts = [[data.draw(st.integers(0, a)) for a in row] for row in anchors]
    valid = [[data.draw(st.booleans()) for _ in range(seq)] for _ in range(2)]
    a_t, v_t, s_t = torch.tensor(anchors), torch.tensor(valid), torch.tensor(starts)
    want = loop_mask(anchors, valid, block, starts)
    dense = dense_dflash_mask(a_t, v_t, block, s_t)
    assert torch.equal(dense, want)
    assert dense.any(-1).all(), "a fully masked query row would give NaN"
    block_mask = flex_dflash_block_mask(a_t, v_t, block, s_t)
    q_len, kv_len = n * block, seq + n * block
    b, q, kv = torch.meshgrid(
        torch.arange(2), torch.arange(q_len), torch.arange(kv_len), indexing="ij"
    )
    assert torch.equal(block_mask.mask_mod(b, torch.zeros_like(b), q, kv), want[:, 0])


def test_zero_context_start_is_the_unpacked_mask() -> None:
    """context_start of zeros is exactly the default (None) on both builders."""
    anchors = torch.tensor([[0, 3, 9], [2, 2, 0]])
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, 8:] = False
    zeros = torch.zeros_like(anchors)
    assert torch.equal(
        dense_dflash_mask(anchors, valid, 4, zeros), dense_dflash_mask(anchors, valid, 4)
    )
    b, q, kv = torch.meshgrid(torch.arange(2), torch.arange(12), torch.arange(23), indexing="ij")
    h = torch.zeros_like(b)
    assert torch.equal(
        flex_dflash_block_mask(anchors, valid, 4, zeros).mask_mod(b, h, q, kv),
        flex_dflash_block_mask(anchors, valid, 4).mask_mod(b, h, q, kv),
    )


def test_eligible_anchors_need_a_supervised_successor() -> None:
    """Anchor a needs loss_mask[a] and loss_mask[a+1]; the last position never anchors."""
    loss = torch.tensor([[0, 1, 1, 0, 1, 1, 1]])
    assert eligible_anchors(loss).tolist() == [[False, True, False, False, True, True, False]]


def test_sampled_anchors_are_sorted_eligible_distinct_and_seeded() -> None:
    """Invariants, padding with keep=False, and reproducibility under one seed."""
    loss = torch.zeros(3, 40, dtype=torch.long)
    loss[0, 5:40] = 1  # 34 eligible
    loss[1, 10:14] = 1  # 3 eligible
    attn = torch.ones_like(loss)
    a = sample_anchors(loss, attn, 8, torch.Generator().manual_seed(3))
    b = sample_anchors(loss, attn, 8, torch.Generator().manual_seed(3))
    c = sample_anchors(loss, attn, 8, torch.Generator().manual_seed(4))
    assert torch.equal(a.positions, b.positions) and torch.equal(a.keep, b.keep)
    assert not torch.equal(a.positions, c.positions)
    assert a.positions.shape == (3, 8)
    assert a.keep.sum(1).tolist() == [8, 3, 0]
    eligible = eligible_anchors(loss, attn)
    for row in range(3):
        kept = a.positions[row][a.keep[row]]
        assert torch.equal(kept, kept.sort().values)
        assert torch.unique(kept).numel() == kept.numel()
        assert eligible[row, kept].all()
        assert a.positions[row][~a.keep[row]].eq(0).all()


def test_anchor_width_shrinks_to_the_most_eligible_row() -> None:
    """With fewer eligible positions than num_anchors, the batch width is the max eligible."""
    loss = torch.zeros(2, 20, dtype=torch.long)
    loss[0, 2:7] = 1
    anchors = sample_anchors(loss, None, 512)
    assert anchors.num_blocks == 4
    assert anchors.positions[0].tolist() == [2, 3, 4, 5]
