"""Memory-bounded drafter steps: a packet split by query rows equals the one-pass step."""

from __future__ import annotations

from dataclasses import fields

import pytest
import torch

from tests.model.helpers import make_drafter
from trainer.model.masks import Anchors, sample_anchors
from trainer.model.objective import StepResult, dflash_objective
from trainer.model.split_step import bounded_objective_backward, split_pieces
from trainer.model.target import TargetModel

BLOCK = 4


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """4 rows of 40: different supervised spans, so rows have different anchor counts (row 3
    has 3 eligible positions only, row 2 is right-padded)."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 500, (4, 40), generator=g)
    attn = torch.ones_like(ids)
    loss = torch.ones_like(ids)
    loss[:, :6] = 0
    attn[2, 30:] = 0
    loss[2, 30:] = 0
    loss[3] = 0
    loss[3, 20:24] = 1
    return ids, loss, attn


def _covered(anchors: Anchors, pieces: list[tuple[slice, slice]]) -> torch.Tensor:
    hits = torch.zeros(anchors.positions.shape, dtype=torch.long)
    for rows, cols in pieces:
        hits[rows, cols] += 1
    return hits


@pytest.mark.parametrize("budget", [None, 1, 3, 4, 5, 8, 12, 32, 33, 64, 200, 10_000])
def test_pieces_cover_every_real_anchor_once_within_the_budget(budget: int | None) -> None:
    _, loss, attn = _batch()
    anchors = sample_anchors(loss, attn, 8, torch.Generator().manual_seed(0))
    pieces = split_pieces(anchors, BLOCK, budget)
    hits = _covered(anchors, pieces)
    assert (hits[anchors.keep] == 1).all()  # every real block exactly once
    assert (hits <= 1).all()
    for rows, cols in pieces:
        q_rows = (rows.stop - rows.start) * (cols.stop - cols.start) * BLOCK
        assert q_rows <= max(budget or q_rows, BLOCK)  # one block is the floor
    if budget is None or budget >= anchors.positions.numel() * BLOCK:
        assert len(pieces) == 1


def test_pieces_group_whole_rows_then_cut_a_row_that_alone_is_over() -> None:
    keep = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 1]], dtype=torch.bool)
    anchors = Anchors(torch.zeros(4, 4, dtype=torch.long), keep)
    # 16 query rows: row 0 alone (4 anchors x 4) fits; rows 1+2 share width 2 (16 rows)
    assert split_pieces(anchors, BLOCK, 16) == [
        (slice(0, 1), slice(0, 4)),
        (slice(1, 3), slice(0, 2)),
        (slice(3, 4), slice(0, 4)),
    ]
    # 8 query rows: rows 0 and 3 are cut into runs of 2 anchors
    assert split_pieces(anchors, BLOCK, 8) == [
        (slice(0, 1), slice(0, 2)),
        (slice(0, 1), slice(2, 4)),
        (slice(1, 2), slice(0, 2)),
        (slice(2, 3), slice(0, 1)),
        (slice(3, 4), slice(0, 2)),
        (slice(3, 4), slice(2, 4)),
    ]
    with pytest.raises(ValueError, match="max_query_rows"):
        split_pieces(anchors, BLOCK, 0)


def _grads(drafter: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _one_pass(
    target: TargetModel, noise: float, gen_seed: int
) -> tuple[StepResult, dict[str, torch.Tensor], torch.Tensor]:
    drafter = make_drafter(target, block_size=BLOCK)
    ids, loss, attn = _batch()
    feats = target.capture(ids, attn)
    gen = torch.Generator().manual_seed(gen_seed)
    res = dflash_objective(
        drafter, None, ids, loss, attn, feats, num_anchors=8, noise=noise, generator=gen
    )
    torch.autograd.backward(res.loss_sum.float())
    return res, _grads(drafter), gen.get_state()


@pytest.mark.parametrize("noise", [0.0, 0.3])
@pytest.mark.parametrize("budget", [None, 2, 4, 12, 32, 64, 96])
def test_split_step_gradients_and_sums_equal_the_one_pass_step(
    target: TargetModel, budget: int | None, noise: float
) -> None:
    """Every budget (whole rows, rows cut into anchor runs, one block per piece) gives the
    one-pass gradients to fp32 tolerance, the same sums, and leaves the generator where the
    one-pass step leaves it (the next packet's anchors do not depend on the budget)."""
    ref, ref_grads, ref_state = _one_pass(target, noise, gen_seed=5)
    drafter = make_drafter(target, block_size=BLOCK)
    ids, loss, attn = _batch()
    feats = target.capture(ids, attn)
    gen = torch.Generator().manual_seed(5)
    got = bounded_objective_backward(
        drafter,
        ids,
        loss,
        attn,
        feats,
        max_query_rows=budget,
        num_anchors=8,
        noise=noise,
        generator=gen,
    )
    assert torch.equal(gen.get_state(), ref_state)
    for f in fields(StepResult):
        a, b = getattr(got, f.name), getattr(ref, f.name).detach()
        assert not a.requires_grad
        if a.dtype.is_floating_point:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f.name)
        else:
            assert torch.equal(a, b), f.name
    grads = _grads(drafter)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        # fp32 tolerance: summation order differs, so the max error is relative to the scale
        err = float((g - ref_grads[name]).abs().max())
        assert err <= 1e-5 * float(ref_grads[name].abs().max()), (name, err)
    if budget is None:  # one piece: the one-pass step itself, bit for bit
        assert all(torch.equal(grads[n], ref_grads[n]) for n in grads)


def test_a_small_budget_really_splits(target: TargetModel) -> None:
    """Guard against a vacuous equality: at budget 12 the packet runs as several pieces."""
    _, loss, attn = _batch()
    anchors = sample_anchors(loss, attn, 8, torch.Generator().manual_seed(5))
    assert len(split_pieces(anchors, BLOCK, 12)) > anchors.positions.shape[0]
    assert len(split_pieces(anchors, BLOCK, 64)) > 1


def test_a_packet_without_anchors_still_backprops_zero(target: TargetModel) -> None:
    drafter = make_drafter(target, block_size=BLOCK)
    ids, _, attn = _batch()
    loss = torch.zeros_like(ids)
    got = bounded_objective_backward(
        drafter, ids, loss, attn, target.capture(ids, attn), max_query_rows=4, num_anchors=8
    )
    assert float(got.weight_sum) == 0 and float(got.loss_sum) == 0
    assert all(p.grad is not None and not p.grad.any() for p in drafter.parameters())


def test_loss_transform_reaches_every_piece(target: TargetModel) -> None:
    """The pipeline's non-finite fault hook poisons the sums and every gradient."""
    drafter = make_drafter(target, block_size=BLOCK)
    ids, loss, attn = _batch()
    got = bounded_objective_backward(
        drafter,
        ids,
        loss,
        attn,
        target.capture(ids, attn),
        max_query_rows=8,
        num_anchors=8,
        generator=torch.Generator().manual_seed(0),
        loss_transform=lambda t: t * float("nan"),
    )
    assert torch.isnan(got.loss_sum)
    assert all(torch.isnan(p.grad).all() for p in drafter.parameters() if p.grad is not None)


def _saved_bytes_and_grads(
    target: TargetModel, checkpoint_layers: bool
) -> tuple[int, dict[str, torch.Tensor]]:
    """Bytes autograd saves for backward in one objective step, and the gradients."""
    drafter = make_drafter(target, block_size=BLOCK, num_layers=3)
    drafter.checkpoint_layers = checkpoint_layers
    ids, loss, attn = _batch()
    feats = target.capture(ids, attn)
    saved = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = dflash_objective(
            drafter,
            None,
            ids,
            loss,
            attn,
            feats,
            num_anchors=8,
            generator=torch.Generator().manual_seed(2),
        )
    torch.autograd.backward(res.loss_sum)
    return saved[0], _grads(drafter)


def test_checkpointed_layers_give_the_same_gradients_and_save_less(target: TargetModel) -> None:
    """model.drafter.checkpoint_layers: each layer's forward is recomputed in backward, so the
    gradients are those of the plain step while far fewer bytes are kept for backward."""
    plain_bytes, plain = _saved_bytes_and_grads(target, False)
    ckpt_bytes, ckpt = _saved_bytes_and_grads(target, True)
    assert plain.keys() == ckpt.keys()
    for name, g in ckpt.items():
        err = float((g - plain[name]).abs().max())
        assert err <= 1e-6 * float(plain[name].abs().max()), (name, err)
    assert ckpt_bytes < 0.5 * plain_bytes, (ckpt_bytes, plain_bytes)
