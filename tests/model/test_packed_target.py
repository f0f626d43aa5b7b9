"""Target capture of packed rows: each document's features equal those of the document alone."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from trainer.model.target import TargetError, TargetModel

DOCS = [[5, 1, 9], [12, 3], [1, 7, 2, 4]]  # document lengths per row (row 1 has a 1-token doc)


def packed_rows(lengths: list[list[int]], seed: int = 0) -> tuple[Tensor, Tensor, list[Tensor]]:
    """Random documents laid end to end per row, padded to the fullest row: ids, document-
    relative positions (the padding tail counted as one more document) and the documents."""
    g = torch.Generator().manual_seed(seed)
    width = max(sum(r) for r in lengths)
    ids = torch.zeros(len(lengths), width, dtype=torch.long)
    pos = torch.zeros_like(ids)
    docs = []
    for r, row in enumerate(lengths):
        at = 0
        for n in row:
            doc = torch.randint(0, 500, (n,), generator=g)
            docs.append(doc)
            ids[r, at : at + n] = doc
            pos[r, at : at + n] = torch.arange(n)
            at += n
        pos[r, at:] = torch.arange(width - at)
    return ids, pos, docs


def test_each_packed_document_captures_as_if_run_alone(target: TargetModel) -> None:
    """fp32, 1e-5: block-diagonal causal attention and positions restarting per document. The
    same rows without position_ids (one long causal sequence) differ, so the check has teeth."""
    ids, pos, docs = packed_rows(DOCS)
    packed = target.capture(ids, position_ids=pos)
    assert packed.dtype == torch.float32 and packed.shape == (3, ids.shape[1], target.feature_size)
    unpacked = target.capture(ids, torch.ones_like(ids))
    k = 0
    for r, row in enumerate(DOCS):
        at = 0
        for n in row:
            alone = target.capture(docs[k][None], torch.ones(1, n, dtype=torch.long))[0]
            torch.testing.assert_close(packed[r, at : at + n], alone, rtol=1e-5, atol=1e-5)
            if at > 0:  # a later document of the row sees its predecessors without packing
                assert (unpacked[r, at : at + n] - alone).abs().max() > 1e-3
            at += n
            k += 1


def test_packed_capture_matches_a_right_padded_batch_of_the_same_documents(
    target: TargetModel,
) -> None:
    """The same documents as the unpacked pipeline collates them (one per row, right-padded,
    attention_mask) give the same features at every real position."""
    ids, pos, docs = packed_rows(DOCS, seed=1)
    packed = target.capture(ids, position_ids=pos)
    width = max(len(d) for d in docs)
    pad_ids = torch.zeros(len(docs), width, dtype=torch.long)
    attn = torch.zeros_like(pad_ids)
    for i, d in enumerate(docs):
        pad_ids[i, : len(d)], attn[i, : len(d)] = d, 1
    padded = target.capture(pad_ids, attn)
    flat = [
        (r, at, n) for r, row in enumerate(DOCS) for at, n in zip(_starts(row), row, strict=True)
    ]
    for i, (r, at, n) in enumerate(flat):
        torch.testing.assert_close(packed[r, at : at + n], padded[i, :n], rtol=1e-5, atol=1e-5)


def _starts(row: list[int]) -> list[int]:
    out, at = [], 0
    for n in row:
        out.append(at)
        at += n
    return out


def test_mismatched_position_ids_are_refused(target: TargetModel) -> None:
    ids, pos, _ = packed_rows(DOCS)
    with pytest.raises(TargetError, match=r"position_ids .* do not match input_ids"):
        target.capture(ids, position_ids=pos[:, :-1])
