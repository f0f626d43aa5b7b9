"""Packed rows laid out one document per row, for the drafter's dense-mask (SDPA) step.

A packed row holds several documents end to end; with a dense [Q, KV] mask every block of the
row attends over the whole row (its context and every block of every document), masked, so
the attention work grows with (anchors per row) x (row length + the row's query rows), where
the same documents in rows of their own cost (anchors per document) x (document length + its
query rows). `unpack_documents` gathers each document that holds a kept anchor into a row of
its own (right-padded to the longest such document), with its hidden states, its tokens and
its anchors moved to document-relative positions. That is exactly the unpacked computation: a
packed block sees only its own document's earlier context and its own block, at
document-relative positions (`trainer.model.objective`), which is what the same block sees in
its document's own row; documents without a kept anchor contribute nothing and are left out.
Flex attention (CUDA) skips masked tiles, so it keeps the packed rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.model.masks import Anchors


@dataclass(frozen=True)
class Unpacked:
    """The documents of packed rows, one per row: what `dflash_objective` takes unpacked."""

    input_ids: Tensor  # [D, L]
    loss_mask: Tensor  # [D, L]
    attention_mask: Tensor  # [D, L] (1 inside the document)
    hidden: Tensor  # [D, L, F]
    anchors: Anchors  # [D, W] document-relative positions


def unpack_documents(
    input_ids: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    hidden: Tensor,
    position_ids: Tensor,
    anchors: Anchors,
) -> Unpacked:
    """One row per document of the packed rows that holds a kept anchor (see module doc).

    A document starts wherever `position_ids` is 0 and runs over the real positions that
    follow (`attention_mask` 1); the padding tail is no document. `anchors` are the packed
    rows' (`objective.draw_anchors` with `position_ids`): ascending within a row, each inside
    its document. Rows keep the documents' order (row by row, left to right).
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
    width = int(lens.max()) if docs else 0
    j = torch.arange(width)
    valid = j[None, :] < lens[:, None]  # [D, L]
    idx = torch.where(valid, starts[:, None] + j, starts[:, None]).flatten()  # padding: token 0
    doc = torch.searchsorted(used, anchor_key)  # each kept anchor's output row
    rank = torch.arange(len(doc)) - (torch.cumsum(per_doc, 0) - per_doc)[doc]
    n = int(per_doc.max()) if docs else 0
    new_pos = torch.zeros(docs, n, dtype=torch.long)
    new_keep = torch.zeros(docs, n, dtype=torch.bool)
    new_pos[doc, rank] = anchor_pos - starts[doc] % seq
    new_keep[doc, rank] = True

    def take(t: Tensor) -> Tensor:
        i = idx.to(t.device)
        if t.dim() == 3:
            return t.flatten(0, 1).index_select(0, i).view(docs, width, t.shape[2])
        out = t.flatten().index_select(0, i).view(docs, width)
        return torch.where(valid.to(out.device), out, torch.zeros((), dtype=out.dtype))

    return Unpacked(
        input_ids=take(input_ids),
        loss_mask=take(loss_mask),
        attention_mask=valid.to(attention_mask.device, attention_mask.dtype),
        hidden=take(hidden),
        anchors=Anchors(new_pos, new_keep),
    )
