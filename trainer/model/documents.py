"""Packed rows laid out one document per row, for the drafter's dense-mask (SDPA) step.

A packed row holds several documents end to end; with a dense [Q, KV] mask every block of the
row attends over the whole row (its context and every block of every document), masked, so
the attention work grows with (anchors per row) x (row length + the row's query rows), where
the same documents in rows of their own cost (anchors per document) x (document length + its
query rows). `unpack_documents` lays each document that holds a kept anchor out as a row of its
own (right-padded to the longest such document): its tokens and masks, its anchors at
document-relative positions, and `index`, where each of its slots sits in the packed rows.
That is exactly the unpacked computation: a packed block sees only its own document's earlier
context and its own block, at document-relative positions (`trainer.model.objective`), which is
what the same block sees in its document's own row; documents without a kept anchor contribute
nothing and are left out.

The hidden states are not copied into that layout: the drafter projects the context (fc,
hidden_norm, each layer's K/V with k_norm and RoPE) on the packed rows, where every position is
a real token, and gathers only each layer's K and V through `index` (`ContextRows`,
`DFlashDrafter.forward(context_rows=)`). Padding the documents to the longest one then costs
attention keys, not context projections (~2 context positions per real token otherwise, on
shuffled lengths). Flex attention (CUDA) skips masked tiles, so it keeps the packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trainer.model.key_widths import KEY_MULTIPLE
from trainer.model.masks import Anchors

GROUP_COST = 16 * 1024
"""Score elements (query rows x keys) one more attention group must save to be worth its call:
an SDPA call forward and backward costs about as much as that many elements on CPU."""


@dataclass(frozen=True)
class ContextRows:
    """Where the drafter's context rows come from when its features are packed rows.

    `index` [D, L]: row d, slot j of the context is flat position `index[d, j]` of the packed
    [R, S] rows (row-major; padding slots repeat the document's first position, masked);
    `positions` [R, S]: the packed rows' document-relative positions, for the context's RoPE.
    `groups`: consecutive (rows, width) runs of the D rows, each attended in a call of its own
    over only its first `width` context slots (no block of the group sees past them); () =
    one group, every row, all L slots.
    """

    index: Tensor
    positions: Tensor
    groups: tuple[tuple[int, int], ...] = ()

    def spans(self) -> list[tuple[slice, int]]:
        """Each group as (its rows, its context width)."""
        if not self.groups:
            return [(slice(0, self.index.shape[0]), self.index.shape[1])]
        out, at = [], 0
        for n, width in self.groups:
            out.append((slice(at, at + n), width))
            at += n
        return out

    def rows(self, docs: slice) -> tuple[slice, ContextRows]:
        """The packed rows documents `docs` come from (one range that holds them all), and
        those documents' `ContextRows` relative to that range."""
        seq = self.positions.shape[1]
        index = self.index[docs]
        firsts = index[:, 0]
        lo, hi = int(firsts.min()) // seq, int(firsts.max()) // seq + 1
        start, stop, _ = docs.indices(self.index.shape[0])
        groups = []
        for span, width in self.spans():
            n = min(stop, span.stop) - max(start, span.start)
            if n > 0:
                groups.append((n, width))
        return slice(lo, hi), ContextRows(index - lo * seq, self.positions[lo:hi], tuple(groups))


def attention_groups(widths: list[int], queries: int, max_groups: int = 3) -> list[int]:
    """Rows per group for rows of context `widths` and `queries` query rows each: the split
    into at most `max_groups` consecutive groups, each attended over its widest row's width
    plus the queries (rounded up to `KEY_MULTIPLE` keys, as the dense mask pads them), that
    costs the fewest score elements, counting `GROUP_COST` per group (ties: the earliest cut)."""
    n = len(widths)
    if n == 0:
        return []
    w = np.asarray(widths, dtype=np.int64)
    # cost[i, j]: rows i..j-1 as one group (inf unless j > i)
    widest = np.zeros((n, n + 1), dtype=np.int64)
    for i in range(n):
        widest[i, i + 1 :] = np.maximum.accumulate(w[i:])
    keys = -(-(widest + queries) // KEY_MULTIPLE) * KEY_MULTIPLE
    span = np.arange(n + 1)[None, :] - np.arange(n)[:, None]
    cost = np.where(span > 0, span * queries * keys + GROUP_COST, np.inf)
    # best[i]: rows i.. in at most g groups (g = 1, 2, ...); cut[g][i]: where its first ends
    best = np.append(np.full(n, np.inf), 0.0)
    cuts = []
    for _ in range(max_groups):
        total = cost + best[None, :]
        cut = np.argmin(total, axis=1)  # the first minimum: the earliest cut
        best = np.append(total[np.arange(n), cut], 0.0)
        cuts.append(cut)
    sizes, i, g = [], 0, max_groups - 1
    while i < n:
        j = int(cuts[g][i])
        sizes.append(j - i)
        i, g = j, g - 1
    return sizes


@dataclass(frozen=True)
class Unpacked:
    """The documents of packed rows, one per row: what `dflash_objective` takes unpacked."""

    input_ids: Tensor  # [D, L]
    loss_mask: Tensor  # [D, L]
    attention_mask: Tensor  # [D, L] (1 inside the document)
    anchors: Anchors  # [D, W] document-relative positions
    index: Tensor  # [D, L] flat positions in the packed rows (see `ContextRows`)
    groups: tuple[tuple[int, int], ...]  # attention groups (see `ContextRows`)

    def take(self, t: Tensor) -> Tensor:
        """`t` [R, S, ...] (a packed-row tensor) in this layout: [D, L, ...], padding slots
        holding the document's first position's values."""
        return _gather(t, self.index)


def _gather(t: Tensor, index: Tensor) -> Tensor:
    """`t` [R, S, ...] at the flat positions `index` [D, L]: [D, L, ...]."""
    i = index.flatten().to(t.device)
    return t.flatten(0, 1).index_select(0, i).view(*index.shape, *t.shape[2:])


def unpack_documents(
    input_ids: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    anchors: Anchors,
    block_size: int = 1,
) -> Unpacked:
    """One row per document of the packed rows that holds a kept anchor (see module doc).

    A document starts wherever `position_ids` is 0 and runs over the real positions that
    follow (`attention_mask` 1); the padding tail is no document. `anchors` are the packed
    rows' (`objective.draw_anchors` with `position_ids`): ascending within a row, each inside
    its document. Rows are ordered by document length, descending (ties in packed order: the
    memory estimate lays them out alike), and cut into `attention_groups`, each attended over
    the context its blocks see (up to its rows' last anchor). The layout is index arithmetic on
    a few hundred host integers per micro-batch, so it runs in numpy (a torch op costs ~10x a
    numpy one at these sizes; the drafter thread pays it every micro-batch).
    """
    seq = input_ids.shape[1]
    real = attention_mask.cpu().numpy().astype(bool, copy=False).ravel()
    first = real & (position_ids.cpu().numpy().ravel() == 0)
    doc_of = np.cumsum(first) - 1  # flat position -> its document (packed order)
    lengths = np.bincount(doc_of[real], minlength=int(first.sum()))
    firsts = np.flatnonzero(first)  # flat index of each document's first token
    keep = anchors.keep.cpu().numpy().ravel()
    row_of = np.repeat(np.arange(anchors.positions.shape[0]), anchors.positions.shape[1])
    flat_anchor = (row_of * seq + anchors.positions.cpu().numpy().ravel())[keep]
    anchor_doc = doc_of[flat_anchor]  # ascending: row-major, ascending within a row
    # the documents holding an anchor, in packed order, and each one's run of anchors
    used, run_start, per_doc = np.unique(anchor_doc, return_index=True, return_counts=True)
    starts, lens = firsts[used], lengths[used]
    docs = len(used)
    which = np.repeat(np.arange(docs), per_doc)  # each kept anchor's document (of `used`)
    rel = flat_anchor - starts[which]  # document-relative anchor positions
    # context a document's blocks see: keys j < anchor, so up to its last anchor (>= 1 slot)
    need = np.maximum(rel[run_start + per_doc - 1], 1) if docs else rel[:0]
    order = np.argsort(-lens, kind="stable")
    per_doc, starts, lens, need = per_doc[order], starts[order], lens[order], need[order]
    n_anchors = int(per_doc.max()) if docs else 0
    widths = need.tolist()
    sizes = attention_groups(widths, n_anchors * block_size)
    groups, row = [], 0
    for k in sizes:
        groups.append((k, max(widths[row : row + k])))
        row += k
    width = int(lens.max()) if docs else 0
    j = np.arange(width)
    valid = j[None, :] < lens[:, None]  # [D, L]
    idx = np.where(valid, starts[:, None] + j, starts[:, None])  # padding: the first token
    out_row = np.argsort(order)[which]  # each kept anchor's output row
    rank = np.arange(len(which)) - run_start[which]  # its place in its document's run
    new_pos = np.zeros((docs, n_anchors), dtype=np.int64)
    new_keep = np.zeros((docs, n_anchors), dtype=bool)
    new_pos[out_row, rank] = rel
    new_keep[out_row, rank] = True
    index = torch.from_numpy(idx.astype(np.int64, copy=False))
    mask = torch.from_numpy(valid)

    def take(t: Tensor) -> Tensor:  # padding slots zeroed, as a padded batch has them
        out = _gather(t, index)
        return torch.where(mask.to(out.device), out, torch.zeros((), dtype=out.dtype))

    return Unpacked(
        input_ids=take(input_ids),
        loss_mask=take(loss_mask),
        attention_mask=mask.to(attention_mask.device, attention_mask.dtype),
        anchors=Anchors(torch.from_numpy(new_pos), torch.from_numpy(new_keep)),
        index=index,
        groups=tuple(groups),
    )
