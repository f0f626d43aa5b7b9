"""The drafter step on packed rows equals the unpacked step on the same documents.

Same documents, captured by the real tiny target both ways (one per right-padded row, and laid
end to end in packed rows with document-relative positions), all eligible anchors drawn (so the
draw is not involved): every sum of the step and every gradient agree to fp32 tolerance, split
into micro-steps or not, with either CE backend. Anchors never cross a document boundary and
labels never leave their document.
"""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch
from torch import Tensor

from trainer.config import LossConfig
from trainer.kernels.common import Backend
from trainer.model.masks import document_eligible
from trainer.model.objective import StepResult, block_labels, draw_anchors
from trainer.model.split_step import bounded_objective_backward
from trainer.model.target import TargetModel

from .helpers import make_drafter

BLOCK = 4
# (length, unsupervised prompt) per document; packed into two rows as ROWS says (row 0: docs
# 0, 1, 2; row 1: docs 3, 4). Doc 2 is one supervised token (no anchor of its own, and doc 1's
# last token before it must not anchor a pair across the boundary).
DOCS = [(11, 3), (7, 2), (1, 0), (14, 5), (6, 1)]
ROWS = [[0, 1, 2], [3, 4]]
ALL = 10_000  # more anchors than any document has: every eligible one is drawn


def documents(seed: int = 0) -> list[tuple[Tensor, Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for n, prompt in DOCS:
        ids = torch.randint(0, 500, (n,), generator=g)
        loss = torch.ones(n, dtype=torch.long)
        loss[:prompt] = 0
        out.append((ids, loss))
    return out


def padded(docs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor]:
    width = max(len(d) for d, _ in docs)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    loss, attn = torch.zeros_like(ids), torch.zeros_like(ids)
    for i, (d, m) in enumerate(docs):
        ids[i, : len(d)], loss[i, : len(d)], attn[i, : len(d)] = d, m, 1
    return ids, loss, attn


def packed(docs: list[tuple[Tensor, Tensor]]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """As `trainer.pipeline.collate.collate_packed` lays them out (tested there)."""
    fills = [sum(len(docs[i][0]) for i in row) for row in ROWS]
    width = max(fills)
    ids = torch.zeros(len(ROWS), width, dtype=torch.long)
    loss, attn, pos = torch.zeros_like(ids), torch.zeros_like(ids), torch.zeros_like(ids)
    for r, row in enumerate(ROWS):
        at = 0
        for i in row:
            d, m = docs[i]
            n = len(d)
            ids[r, at : at + n], loss[r, at : at + n], attn[r, at : at + n] = d, m, 1
            pos[r, at : at + n] = torch.arange(n)
            at += n
        pos[r, at:] = torch.arange(width - at)
    return ids, loss, attn, pos


def _grads(drafter: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _step(
    target: TargetModel,
    batch: tuple[Tensor, ...],
    *,
    max_query_rows: int | None = None,
    ce_backend: Backend = "auto",
    noise: float = 0.0,
    num_anchors: int = ALL,
    unpack: bool | None = None,
    objective: LossConfig | None = None,
) -> tuple[StepResult, dict[str, Tensor]]:
    """One drafter step on `batch` (padded, or packed with position ids) from a fresh drafter:
    its sums and gradients. `unpack` as `bounded_objective_backward`'s (None: by backend);
    `objective`: `[model.loss]` (distillation: the last hidden state captured with the rest)."""
    ids, loss, attn = batch[:3]
    pos = batch[3] if len(batch) > 3 else None
    objective = objective or LossConfig()
    final = objective.distills
    if pos is None:
        feats = target.capture(ids, attn, final=final)
    else:
        feats = target.capture(ids, position_ids=pos, final=final)
    width = target.feature_size
    feats, teacher = (feats[..., :width], feats[..., width:]) if final else (feats, None)
    drafter = make_drafter(target, block_size=BLOCK)
    res = bounded_objective_backward(
        drafter,
        ids,
        loss,
        attn,
        feats,
        max_query_rows=max_query_rows,
        num_anchors=num_anchors,
        noise=noise,
        generator=torch.Generator().manual_seed(3),
        ce_backend=ce_backend,
        position_ids=pos,
        unpack=unpack,
        loss=objective,
        teacher=teacher,
    )
    return res, _grads(drafter)


def _assert_same(got: StepResult, ref: StepResult) -> None:
    for f in fields(StepResult):
        a, b = getattr(got, f.name), getattr(ref, f.name)
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f.name)
        else:
            assert torch.equal(a, b), f.name


def _assert_same_grads(got: dict[str, Tensor], ref: dict[str, Tensor]) -> None:
    assert got.keys() == ref.keys()
    for name, g in got.items():
        err = float((g - ref[name]).abs().max())
        assert err <= 2e-5 * float(ref[name].abs().max()), (name, err)


@pytest.mark.parametrize("ce_backend", ["chunked", "dense"])
@pytest.mark.parametrize("max_query_rows", [None, 8, 2])
def test_packed_step_equals_the_padded_step_on_the_same_documents(
    target: TargetModel, max_query_rows: int | None, ce_backend: Backend
) -> None:
    """Loss, weight, accuracy, streak and per-slot sums and every gradient: packed (split into
    micro-steps of `max_query_rows` or not) == padded in one pass. The loss per optimizer step
    is loss_sum / weight_sum of the global sums, so it is equal too."""
    docs = documents()
    ref, ref_grads = _step(target, padded(docs), ce_backend=ce_backend)
    got, grads = _step(target, packed(docs), max_query_rows=max_query_rows, ce_backend=ce_backend)
    assert int(ref.n_pred) > 20 and int(ref.n_blocks) > 10  # not vacuous
    _assert_same(got, ref)
    _assert_same_grads(grads, ref_grads)
    torch.testing.assert_close(got.loss_sum / got.weight_sum, ref.loss_sum / ref.weight_sum)


@pytest.mark.parametrize("unpack", [True, False])
@pytest.mark.parametrize("max_query_rows", [None, 2])
def test_packed_dpace_and_distillation_equal_the_padded_step(
    target: TargetModel, max_query_rows: int | None, unpack: bool
) -> None:
    """With D-PACE weights and logit distillation, packed rows (documents unpacked into rows
    of their own, or kept packed as the flex path keeps them) give the padded step's sums and
    gradients: each slot's teacher is its own document's position a+k-1 either way."""
    docs = documents()
    objective = LossConfig(type="dpace", kd_weight=0.5)
    ref, ref_grads = _step(target, padded(docs), objective=objective)
    got, grads = _step(
        target, packed(docs), max_query_rows=max_query_rows, unpack=unpack, objective=objective
    )
    _assert_same(got, ref)
    _assert_same_grads(grads, ref_grads)
    plain, _ = _step(target, padded(docs))
    assert not torch.allclose(plain.loss_sum, ref.loss_sum)  # the loss is not the CE's


def test_without_document_boundaries_the_step_differs(target: TargetModel) -> None:
    """The same packed rows as one long document each (positions 0..L-1): cross-document
    anchors, context and labels change the sums, so the equality above has teeth."""
    docs = documents()
    ids, loss, attn, _ = packed(docs)
    ref, _ = _step(target, padded(docs))
    plain = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
    got, _ = _step(target, (ids, loss, attn, plain))
    assert int(got.n_pred) > int(ref.n_pred)  # pairs across boundaries became anchors/labels
    assert not torch.allclose(got.loss_sum, ref.loss_sum)


def test_noise_and_a_small_anchor_count_run_on_packed_rows(target: TargetModel) -> None:
    """The noise option and num_anchors per document: noise changes the loss; with 2 anchors
    per document, each document holds at most 2 (a row of 3 documents may hold 4 or more)."""
    docs = documents()
    clean, _ = _step(target, packed(docs), num_anchors=2)
    noisy, _ = _step(target, packed(docs), num_anchors=2, noise=0.5)
    assert torch.isfinite(noisy.loss_sum) and not torch.allclose(noisy.loss_sum, clean.loss_sum)
    _, loss, attn, pos = packed(docs)
    anchors = draw_anchors(loss, attn, 2, torch.Generator().manual_seed(0), pos)
    doc = (pos == 0).cumsum(1)
    for r in range(len(ROWS)):
        kept = anchors.positions[r][anchors.keep[r]]
        per_doc = torch.bincount(doc[r, kept], minlength=int(doc[r].max()) + 1)
        assert int(per_doc.max()) <= 2
        assert len(kept) == int(
            sum(min(2, int(e)) for e in _eligible_per_doc(loss[r], attn[r], pos[r]))
        )


def _eligible_per_doc(loss: Tensor, attn: Tensor, pos: Tensor) -> list[int]:
    ok = document_eligible(loss[None], attn[None], pos[None])[0]
    doc = (pos == 0).cumsum(0)
    return [int(ok[doc == d].sum()) for d in range(1, int(doc.max()) + 1)]


def test_no_anchor_pairs_or_labels_across_a_document_boundary() -> None:
    """Row [doc 0: 3 tokens | doc 1: 4 tokens], all supervised: position 2 (doc 0's last) is not
    eligible though position 3 is supervised, and an anchor at 1 labels only position 2."""
    pos = torch.tensor([[0, 1, 2, 0, 1, 2, 3]])
    ones = torch.ones_like(pos)
    ok = document_eligible(ones, ones, pos)
    assert ok.tolist() == [[True, True, False, True, True, True, False]]
    anchors = draw_anchors(ones, ones, ALL, torch.Generator().manual_seed(0), pos)
    assert anchors.positions.tolist() == [[0, 1, 3, 4, 5]]
    ids = torch.arange(10, 17)[None]
    labels, valid = block_labels(ids, ones, ones, anchors, BLOCK, pos)
    assert valid[0, 1].tolist() == [True, False, False]  # anchor 1: label 2 only
    assert valid[0, 2].tolist() == [True, True, True]  # anchor 3: labels 4, 5, 6
    assert labels[0, 2].tolist() == [14, 15, 16]


def test_packed_step_forward_on_flex_equals_sdpa(target: TargetModel) -> None:
    """The CUDA path's attention (flex_attention with the document BlockMask, eager here:
    CPU flex is forward-only) gives the SDPA step's sums on packed rows."""
    from trainer.model.objective import dflash_objective

    ids, loss, attn, pos = packed(documents())
    feats = target.capture(ids, position_ids=pos)
    drafter = make_drafter(target, block_size=BLOCK)
    anchors = draw_anchors(loss, attn, ALL, torch.Generator().manual_seed(0), pos)
    with torch.no_grad():
        got, ref = (
            dflash_objective(
                drafter,
                None,
                ids,
                loss,
                attn,
                feats,
                anchors=anchors,
                attn_backend=backend,
                position_ids=pos,
            )
            for backend in ("flex", "sdpa")
        )
    _assert_same(got, ref)
