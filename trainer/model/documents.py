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

import torch
from torch import Tensor

from trainer.model.attention import KEY_MULTIPLE
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
    costs the fewest score elements, counting `GROUP_COST` per group."""
    n = len(widths)
    inf = float("inf")
    # best[g][i]: cost of rows i.. in at most g groups; cut[g][i]: where the first one ends
    best = [[0.0 if i == n else inf for i in range(n + 1)] for _ in range(max_groups + 1)]
    cut = [[n] * (n + 1) for _ in range(max_groups + 1)]
    for g in range(1, max_groups + 1):
        for i in range(n - 1, -1, -1):
            widest = 0
            for j in range(i + 1, n + 1):
                widest = max(widest, widths[j - 1])
                keys = -(-(widest + queries) // KEY_MULTIPLE) * KEY_MULTIPLE
                c = (j - i) * queries * keys + GROUP_COST + best[g - 1][j]
                if c < best[g][i]:
                    best[g][i], cut[g][i] = c, j
    sizes, i, g = [], 0, max_groups
    while i < n:
        sizes.append(cut[g][i] - i)
        i, g = cut[g][i], g - 1
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
        i = self.index.flatten().to(t.device)
        return t.flatten(0, 1).index_select(0, i).view(*self.index.shape, *t.shape[2:])


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
    the context its blocks see (up to its rows' last anchor).
    """
    rows, seq = input_ids.shape
    pos = position_ids.cpu()
    real = attention_mask.cpu().bool()
    docnum = (pos == 0).cumsum(1) - 1  # [R, S] document number within its row
    key = torch.arange(rows)[:, None] * seq + docnum  # unique per (row, document)
    keep = anchors.keep.cpu()
    at = anchors.positions.cpu()
    anchor_key = key.gather(1, at)[keep]  # row-major: ascending (row, document), then position
    anchor_pos = at[keep]
    flat_real = real.flatten()
    doc_keys, lengths = torch.unique_consecutive(key.flatten()[flat_real], return_counts=True)
    firsts = torch.nonzero(flat_real).squeeze(1)[torch.cumsum(lengths, 0) - lengths]
    # the documents holding an anchor, in order; d = that document's row in the output
    used, per_doc = torch.unique_consecutive(anchor_key, return_counts=True)
    which = torch.searchsorted(doc_keys, used)
    starts, lens = firsts[which], lengths[which]  # flat index of each document's first token
    docs = len(used)
    # context a document's blocks see: keys j < anchor, so up to its last anchor (>= 1 slot)
    last = torch.zeros(docs, dtype=torch.long)
    doc_of = torch.searchsorted(used, anchor_key)
    rel = anchor_pos - starts[doc_of] % seq
    last.scatter_reduce_(0, doc_of, rel, reduce="amax")
    need = last.clamp(min=1)
    order = torch.sort(lens, descending=True, stable=True).indices
    used, per_doc, starts, lens, need = (t[order] for t in (used, per_doc, starts, lens, need))
    n_anchors = int(per_doc.max()) if docs else 0
    widths = need.tolist()
    sizes = attention_groups(widths, n_anchors * block_size)
    groups, row = [], 0
    for k in sizes:
        groups.append((k, max(widths[row : row + k])))
        row += k
    width = int(lens.max()) if docs else 0
    j = torch.arange(width)
    valid = j[None, :] < lens[:, None]  # [D, L]
    idx = torch.where(valid, starts[:, None] + j, starts[:, None]).flatten()  # padding: token 0
    doc = torch.argsort(order)[doc_of]  # each kept anchor's output row
    # the anchors come in runs per document, ascending: rank = place in its document's run
    run = torch.bincount(doc_of, minlength=docs)
    rank = torch.arange(len(doc_of)) - (torch.cumsum(run, 0) - run)[doc_of]
    new_pos = torch.zeros(docs, n_anchors, dtype=torch.long)
    new_keep = torch.zeros(docs, n_anchors, dtype=torch.bool)
    new_pos[doc, rank] = rel
    new_keep[doc, rank] = True

    def take(t: Tensor) -> Tensor:
        out = t.flatten().index_select(0, idx.to(t.device)).view(docs, width)
        return torch.where(valid.to(out.device), out, torch.zeros((), dtype=out.dtype))

    return Unpacked(
        input_ids=take(input_ids),
        loss_mask=take(loss_mask),
        attention_mask=valid.to(attention_mask.device, attention_mask.dtype),
        anchors=Anchors(new_pos, new_keep),
        index=idx.view(docs, width),
        groups=tuple(groups),
    )
