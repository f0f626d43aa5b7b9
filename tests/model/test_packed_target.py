"""Target capture of packed rows: each document's features equal those of the document alone."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from torch import Tensor
from transformers import Qwen3Config, Qwen3ForCausalLM

from trainer.model.errors import TargetError
from trainer.model.target import TargetModel

DOCS = [[5, 1, 9], [12, 3], [1, 7, 2, 4]]  # document lengths per row (row 1 has a 1-token doc)
# Lengths on both sides of the 16-slot widths, repeated lengths, 1-token documents, and padding
# tails of 0 to 69 positions: several length groups (`trainer.model.target_attention`).
MANY_DOCS = [[47, 1, 17, 16], [33, 16, 2, 9, 1], [1, 1, 70], [81], [5, 5, 5, 5], [12]]


@contextmanager
def document_attention(
    target: TargetModel, on: bool, max_groups: int | None = None
) -> Iterator[None]:
    """Packed captures through the grouped per-document attention (on) or transformers' mask."""
    before = target.document_attention, target.document_groups
    target.document_attention, target.document_groups = on, max_groups
    try:
        yield
    finally:
        target.document_attention, target.document_groups = before


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


@pytest.mark.parametrize("grouped", [True, False], ids=["document-groups", "mask"])
def test_each_packed_document_captures_as_if_run_alone(target: TargetModel, grouped: bool) -> None:
    """fp32, 1e-5: block-diagonal causal attention and positions restarting per document. The
    same rows without position_ids (one long causal sequence) differ, so the check has teeth."""
    assert target.document_attention  # the default on a CPU target
    ids, pos, docs = packed_rows(DOCS)
    with document_attention(target, grouped):
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


@pytest.mark.parametrize("max_groups", [1, 2, 3, 8])
def test_every_document_and_padding_tail_in_any_grouping_captures_as_if_run_alone(
    target: TargetModel, max_groups: int
) -> None:
    """The grouped document attention, one to eight groups: every document, 1-token ones and
    each row's padding tail (a document of its own) included, equals the same tokens captured
    alone; so does the whole batch captured through transformers' mask. Documents of one
    length share a group's rows: a mixed-up gather or scatter puts another document's random
    tokens at their positions and fails."""
    ids, pos, _docs = packed_rows(MANY_DOCS, seed=2)
    with document_attention(target, True, max_groups):
        packed = target.capture(ids, position_ids=pos)
    with document_attention(target, False):
        masked = target.capture(ids, position_ids=pos)
    torch.testing.assert_close(packed, masked, rtol=1e-5, atol=1e-5)
    width = ids.shape[1]
    for r, row in enumerate(MANY_DOCS):
        spans = list(zip(_starts(row), row, strict=True))
        if sum(row) < width:
            spans.append((sum(row), width - sum(row)))  # the padding tail
        for at, n in spans:
            alone = target.capture(ids[r : r + 1, at : at + n], torch.ones(1, n, dtype=torch.long))
            torch.testing.assert_close(packed[r, at : at + n], alone[0], rtol=1e-5, atol=1e-5)


def test_grouped_capture_leaves_the_model_as_it_was(target: TargetModel) -> None:
    """The attention implementation is switched for the packed capture only: a capture without
    position_ids and a full forward afterwards run transformers' own path (sdpa)."""
    ids, pos, _ = packed_rows(DOCS)
    before = target.model.config._attn_implementation
    target.capture(ids, position_ids=pos)
    assert target.model.config._attn_implementation == before == "sdpa"
    logits, feats = target.forward_with_capture(ids, attention_mask=torch.ones_like(ids))
    assert torch.isfinite(logits).all() and feats.shape[:2] == ids.shape


def test_document_attention_is_off_for_sliding_window_layers(tiny_dir: Path) -> None:
    """Grouped attention ignores a sliding window, so a target with one keeps the mask path."""
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert TargetModel.load(tiny_dir, [1], device="cpu").document_attention
    cfg["layer_types"][0] = "sliding_attention"
    cfg["sliding_window"] = 4
    model = Qwen3ForCausalLM(Qwen3Config(**cfg))
    assert not TargetModel(model, [1]).document_attention


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


@pytest.mark.parametrize("max_groups", [1, 8])
def test_with_the_padding_marked_the_real_tokens_run_as_one_flat_row(
    target: TargetModel, max_groups: int
) -> None:
    """The pipeline passes the attention mask: the rows' real tokens are then captured as one
    flat row (no padding slot computed), bit for bit the features of the rows captured without
    it on every real position (to fp32 rounding), and zeros on the padding tails. Refused when the mask's shape is
    not the rows'."""
    ids, pos, _docs = packed_rows(MANY_DOCS, seed=3)
    attn = torch.zeros_like(ids)
    for r, row in enumerate(MANY_DOCS):
        attn[r, : sum(row)] = 1
    assert not bool(attn.bool().all())  # there are padding tails to skip
    with document_attention(target, True, max_groups):
        rows = target.capture(ids, position_ids=pos)
        flat = target.capture(ids, attn, position_ids=pos)
        with pytest.raises(TargetError, match=r"attention_mask .* do not match input_ids"):
            target.capture(ids, attn[:, :-1], position_ids=pos)
    real = attn.bool()
    torch.testing.assert_close(flat[real], rows[real], rtol=1e-6, atol=1e-6)
    assert not flat[~real].any()
    with document_attention(target, False):  # transformers' path ignores the mask, as before
        torch.testing.assert_close(
            target.capture(ids, attn, position_ids=pos)[real], rows[real], rtol=1e-5, atol=1e-5
        )
