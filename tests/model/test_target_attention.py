"""The grouped document layout of packed target rows (`trainer.model.target_attention`)."""

from __future__ import annotations

import inspect
import itertools
import random

import pytest
import torch
from torch import nn

from trainer.model.target_attention import (
    LAYOUT_KWARG,
    ROW_KEY_COST,
    WIDTH_MULTIPLE,
    _split,
    document_attention_forward,
    document_layout,
)


def _positions(rows: list[list[int]]) -> torch.Tensor:
    """Document-relative positions of rows of documents, each row padded with a tail document
    to the longest row."""
    width = max(sum(r) for r in rows)
    out = []
    for row in rows:
        pos = [p for n in row for p in range(n)]
        out.append(pos + list(range(width - len(pos))))
    return torch.tensor(out)


def _documents(pos: torch.Tensor) -> list[list[int]]:
    """The flattened packed indices of each document, from the positions (new at each row's
    start and wherever a position is not its predecessor's + 1)."""
    docs: list[list[int]] = []
    b, t = pos.shape
    for r in range(b):
        for c in range(t):
            if c == 0 or pos[r, c] != pos[r, c - 1] + 1:
                docs.append([])
            docs[-1].append(r * t + c)
    return docs


@pytest.mark.parametrize("max_groups", [1, 2, 3, 8])
def test_layout_puts_each_document_in_a_row_of_its_own_and_back(max_groups: int) -> None:
    rows = [[47, 1, 17, 16], [33, 16, 2, 9, 1], [1, 1, 70], [81], [5, 5, 5, 5], [12]]
    pos = _positions(rows)
    layout = document_layout(pos, max_groups=max_groups)
    b, t = pos.shape
    assert (layout.batch, layout.length) == (b, t)
    assert 1 <= len(layout.groups) <= max_groups
    # every packed position reads back from its own slot
    assert torch.equal(layout.gather[layout.scatter], torch.arange(b * t))
    slots, at = [], 0
    for g in layout.groups:
        assert g.width < WIDTH_MULTIPLE // 2 or g.width % WIDTH_MULTIPLE == 0
        block = layout.gather[at : at + g.rows * g.width].view(g.rows, g.width)
        slots += [row.tolist() for row in block]
        at += g.rows * g.width
    assert at == layout.padded_positions
    docs = _documents(pos)
    assert len(slots) == len(docs)
    seen = []
    for row in slots:
        doc = next(d for d in docs if d[0] == row[0])
        n = len(doc)
        assert len(row) >= n and row[:n] == doc and set(row[n:]) <= {doc[-1]}
        seen.append(doc[0])
    assert sorted(seen) == [d[0] for d in docs]  # each document exactly once
    lengths = [len(next(d for d in docs if d[0] == s)) for s in seen]
    assert lengths == sorted(lengths, reverse=True)  # longest first


def test_a_document_is_a_run_of_consecutive_positions_not_a_restart_at_zero() -> None:
    pos = torch.tensor([[3, 4, 5, 0, 1, 7, 8]])
    layout = document_layout(pos, max_groups=1)
    assert layout.groups[0].rows == 3 and layout.groups[0].width == 3
    assert layout.gather.view(3, 3).tolist() == [[0, 1, 2], [3, 4, 4], [5, 6, 6]]


def _cost(widths: list[int], spans: list[tuple[int, int]], group_cost: float) -> float:
    return sum(
        (hi - lo) * widths[lo] * (widths[lo] + ROW_KEY_COST) + group_cost for lo, hi in spans
    )


@pytest.mark.parametrize("seed", range(6))
def test_split_is_the_cheapest_cut_of_the_sorted_widths(seed: int) -> None:
    """Against every cut into contiguous groups, when the group count is not capped."""
    rng = random.Random(seed)
    widths = sorted((rng.choice([1, 3, 16, 32, 48, 96, 160]) for _ in range(9)), reverse=True)
    group_cost = rng.choice([0.0, 4000.0, 50_000.0])
    spans = _split(widths, len(widths), group_cost)
    assert spans[0][0] == 0 and spans[-1][1] == len(widths)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(spans))
    best = min(
        _cost(widths, list(itertools.pairwise((0, *cuts, len(widths)))), group_cost)
        for k in range(len(widths))
        for cuts in itertools.combinations(range(1, len(widths)), k)
    )
    assert _cost(widths, spans, group_cost) == pytest.approx(best)
    capped = _split(widths, 2, group_cost)
    assert len(capped) <= 2 and capped[0][0] == 0 and capped[-1][1] == len(widths)


def test_bad_positions_are_refused() -> None:
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        document_layout(torch.arange(4))
    with pytest.raises(ValueError, match="max_groups"):
        document_layout(torch.arange(4)[None], max_groups=0)


def test_the_attention_refuses_a_missing_layout_or_a_mask() -> None:
    q = torch.randn(1, 4, 5, 8)
    kv = torch.randn(1, 2, 5, 8)
    layout = document_layout(torch.tensor([[0, 1, 2, 0, 1]]))
    with pytest.raises(ValueError, match=LAYOUT_KWARG):
        document_attention_forward(nn.Module(), q, kv, kv, None)
    with pytest.raises(ValueError, match="no mask"):
        document_attention_forward(
            nn.Module(),
            q,
            kv,
            kv,
            torch.ones(1, 1, 5, 5, dtype=torch.bool),
            dflash_document_layout=layout,
        )
    out, weights = document_attention_forward(
        nn.Module(), q, kv, kv, None, dflash_document_layout=layout
    )
    assert out.shape == (1, 5, 4, 8) and weights is None


def test_the_keyword_is_the_attention_functions_parameter() -> None:
    """transformers hands the layout over by this name from the decoder's **kwargs."""
    assert LAYOUT_KWARG in inspect.signature(document_attention_forward).parameters
