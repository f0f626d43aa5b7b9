"""Packed rows unpacked for the drafter's SDPA step (`trainer.model.documents`).

The drafter step on packed rows may run on the packed rows themselves (document masks inside
each row) or on the documents laid one per row (`unpack=True`, SDPA's default): both are the
unpacked computation on the same documents, so each equals the padded step, split or not, and
the two equal each other with noise and a drawn anchor subset (the draws happen on the packed
rows before unpacking). The unpacked layout itself is checked against the padded documents.
"""

from __future__ import annotations

import pytest
import torch

from trainer.model.documents import GROUP_COST, attention_groups, unpack_documents
from trainer.model.key_widths import KEY_MULTIPLE
from trainer.model.masks import sample_anchors
from trainer.model.objective import draw_anchors
from trainer.model.target import TargetModel

from .test_packed_objective import (
    ALL,
    BLOCK,
    DOCS,
    _assert_same,
    _assert_same_grads,
    _step,
    documents,
    packed,
    padded,
)


@pytest.mark.parametrize("unpack", [True, False, None])
@pytest.mark.parametrize("max_query_rows", [None, 8, 2])
def test_both_layouts_equal_the_padded_step(
    target: TargetModel, unpack: bool | None, max_query_rows: int | None
) -> None:
    docs = documents()
    ref, ref_grads = _step(target, padded(docs), unpack=None)
    got, grads = _step(target, packed(docs), unpack=unpack, max_query_rows=max_query_rows)
    assert int(ref.n_pred) > 20 and int(ref.n_blocks) > 10  # not vacuous
    _assert_same(got, ref)
    _assert_same_grads(grads, ref_grads)


@pytest.mark.parametrize("max_query_rows", [None, 8])
def test_unpacked_equals_packed_rows_with_noise_and_drawn_anchors(
    target: TargetModel, max_query_rows: int | None
) -> None:
    """2 anchors per document drawn from the generator, then noise: the same draws either way
    (so runs and resumes do not depend on the layout), the same sums and gradients."""
    batch = packed(documents())
    rows, rows_grads, got, grads = (
        *_step(
            target, batch, unpack=False, noise=0.5, num_anchors=2, max_query_rows=max_query_rows
        ),
        *_step(target, batch, unpack=True, noise=0.5, num_anchors=2, max_query_rows=max_query_rows),
    )
    assert int(rows.n_blocks) > 4
    _assert_same(got, rows)
    _assert_same_grads(grads, rows_grads)


def test_the_unpacked_rows_are_the_padded_documents_with_an_anchor(target: TargetModel) -> None:
    """One row per document holding an anchor (doc 2, one token, holds none and is left out),
    longest first, right-padded to the longest: its tokens, loss mask, attention, hidden states (gathered through `index`) and
    its anchors at document-relative positions, as the padded layout has them."""
    docs = documents()
    ids, loss, attn, pos = packed(docs)
    feats = target.capture(ids, position_ids=pos)
    anchors = draw_anchors(loss, attn, ALL, torch.Generator().manual_seed(0), pos)
    u = unpack_documents(ids, loss, attn, pos, anchors, BLOCK)
    kept = sorted((i for i in range(len(DOCS)) if DOCS[i][0] > 1), key=lambda i: -DOCS[i][0])
    assert u.input_ids.shape[0] == len(kept) == len(DOCS) - 1
    p_ids, p_loss, p_attn = padded([docs[i] for i in kept])
    width = int(p_attn.sum(1).max())
    assert torch.equal(u.input_ids, p_ids[:, :width])
    assert torch.equal(u.loss_mask, p_loss[:, :width])
    assert torch.equal(u.attention_mask, p_attn[:, :width])
    p_feats = target.capture(p_ids, p_attn)
    real = p_attn[:, :width].bool()
    hidden = u.take(feats)  # what the drafter's gathered context rows see
    torch.testing.assert_close(hidden[real], p_feats[:, :width][real], rtol=1e-5, atol=1e-5)
    ref = sample_anchors(p_loss, p_attn, ALL, torch.Generator().manual_seed(0))
    assert torch.equal(u.anchors.keep, ref.keep)
    assert torch.equal(u.anchors.positions[u.anchors.keep], ref.positions[ref.keep])
    # groups cover the rows in order; each sees up to its rows' last anchor (every eligible
    # position is drawn: a document's last anchor is its next-to-last token)
    assert sum(n for n, _ in u.groups) == len(kept)
    at = 0
    for n, w in u.groups:
        assert w == max(DOCS[i][0] - 2 for i in kept[at : at + n])
        at += n


def test_attention_groups_are_the_cheapest_split() -> None:
    """The split into at most 3 consecutive groups costs the fewest score elements (each group
    over its widest row plus the queries, in whole KEY_MULTIPLEs) plus GROUP_COST per group
    (checked against every split)."""
    import itertools

    def cost(widths: list[int], sizes: list[int], q: int) -> float:
        total, at = 0.0, 0
        for n in sizes:
            keys = -(-(max(widths[at : at + n]) + q) // KEY_MULTIPLE) * KEY_MULTIPLE
            total += n * q * keys + GROUP_COST
            at += n
        return total

    g = torch.Generator().manual_seed(1)
    for trial in range(40):
        n = 1 + trial % 14
        widths = torch.randint(1, 400, (n,), generator=g).tolist()
        q = 4 * int(torch.randint(1, 9, (1,), generator=g))
        got = attention_groups(widths, q)
        assert sum(got) == n and 1 <= len(got) <= 3 and all(k > 0 for k in got)
        best = min(
            cost(widths, [b - a for a, b in itertools.pairwise((0, *cuts, n))], q)
            for k in range(3)
            for cuts in itertools.combinations(range(1, n), k)
        )
        assert cost(widths, got, q) == best
    assert attention_groups([], 8) == []
    assert attention_groups([300] + [10] * 12, 32) != [13]  # one long document: split it off


@pytest.mark.parametrize("max_query_rows", [None, 8, 2])
def test_attention_groups_apart_equal_one_group(
    target: TargetModel, monkeypatch: pytest.MonkeyPatch, max_query_rows: int | None
) -> None:
    """With groups free (GROUP_COST 0: a group wherever it saves a key), the step still equals
    the padded one: each group attends over only its own context width."""
    import trainer.model.documents as documents_module

    docs = documents()
    ref, ref_grads = _step(target, padded(docs), unpack=None)
    monkeypatch.setattr(documents_module, "GROUP_COST", 0)
    ids, loss, attn, pos = packed(docs)
    anchors = draw_anchors(loss, attn, ALL, torch.Generator().manual_seed(0), pos)
    assert len(unpack_documents(ids, loss, attn, pos, anchors, BLOCK).groups) == 3
    got, grads = _step(target, (ids, loss, attn, pos), unpack=True, max_query_rows=max_query_rows)
    _assert_same(got, ref)
    _assert_same_grads(grads, ref_grads)


def test_no_anchor_at_all_gives_the_zero_step(target: TargetModel) -> None:
    """Nothing supervised: no document is unpacked, the step is the empty one (zero sums that
    still reach every parameter), as on the packed rows."""
    ids, loss, attn, pos = packed(documents())
    none = torch.zeros_like(loss)
    for unpack in (True, False):
        res, grads = _step(target, (ids, none, attn, pos), unpack=unpack)
        assert float(res.loss_sum) == 0.0 and int(res.n_blocks) == 0
        assert grads and all(float(g.abs().sum()) == 0.0 for g in grads.values())
