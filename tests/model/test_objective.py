"""The one-pass multi-anchor objective: equivalence, labels, weights, metrics, NaN safety."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from tests.model.helpers import MASK_ID, make_batch, make_drafter
from trainer.model.attention import build_mask
from trainer.model.drafter import default_gamma
from trainer.model.losses import slot_weights
from trainer.model.masks import Anchors, sample_anchors
from trainer.model.objective import block_labels, dflash_objective, streaks
from trainer.model.target import TargetModel


def test_one_pass_forward_equals_separate_single_block_forwards(target: TargetModel) -> None:
    """Each block of the masked multi-anchor pass equals an inference pass on features[:a]."""
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch()
    feats = target.capture(ids, attn)
    anchors = sample_anchors(loss, attn, 6, torch.Generator().manual_seed(0))
    pos = anchors.positions
    block_ids = drafter.block_input_ids(ids.gather(1, pos))
    block_pos = (pos[:, :, None] + torch.arange(4)).flatten(1)
    with torch.no_grad():
        multi = drafter(feats, block_ids, block_pos, build_mask(pos, attn, 4, "sdpa"))
        multi_flex = drafter(feats, block_ids, block_pos, build_mask(pos, attn, 4, "flex"))
        for row in range(2):
            for n in range(anchors.num_blocks):
                if not anchors.keep[row, n]:
                    continue
                a = int(pos[row, n])
                single = drafter(
                    feats[row : row + 1, :a],
                    block_ids[row : row + 1, 4 * n : 4 * n + 4],
                    torch.arange(a, a + 4)[None],
                )
                torch.testing.assert_close(
                    multi[row, 4 * n : 4 * n + 4], single[0], atol=1e-5, rtol=1e-5
                )
    torch.testing.assert_close(multi_flex, multi, atol=1e-5, rtol=1e-5)


def test_block_inputs_are_anchor_then_mask_tokens(target: TargetModel) -> None:
    """Block n is [x_a, mask, ..., mask]."""
    drafter = make_drafter(target, block_size=4)
    got = drafter.block_input_ids(torch.tensor([[7, 9]]))
    assert got.tolist() == [[7, MASK_ID, MASK_ID, MASK_ID, 9, MASK_ID, MASK_ID, MASK_ID]]


def test_slot_k_is_labelled_with_the_token_at_anchor_plus_k() -> None:
    """Same-position labels (slot k <-> a+k); out-of-range, unsupervised, padded slots invalid."""
    ids = torch.arange(100, 110)[None]
    loss = torch.tensor([[0, 1, 1, 1, 1, 1, 0, 1, 1, 1]])
    attn = torch.ones_like(ids)
    anchors = Anchors(torch.tensor([[1, 7, 0]]), torch.tensor([[True, True, False]]))
    labels, valid = block_labels(ids, loss, attn, anchors, 4)
    assert labels[0, 0].tolist() == [102, 103, 104]
    assert valid[0, 0].tolist() == [True, True, True]
    assert labels[0, 1, :2].tolist() == [108, 109]
    assert valid[0, 1].tolist() == [True, True, False]  # position 10 is past the row
    assert not valid[0, 2].any()


def test_slot_weights_decay_and_default_gammas() -> None:
    """w_k = exp(-(k-1)/gamma) with gamma 7/5/4 for block 16/10/8."""
    assert (default_gamma(16), default_gamma(10), default_gamma(8)) == (7.0, 5.0, 4.0)
    w = slot_weights(16, 7.0)
    assert w.shape == (15,)
    assert w[0] == 1.0
    assert math.isclose(float(w[7]), math.exp(-1.0), rel_tol=1e-6)


def test_loss_sum_equals_dense_weighted_cross_entropy(target: TargetModel) -> None:
    """loss_sum/weight_sum match a dense computation with full logits, for given anchors."""
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch()
    feats = target.capture(ids, attn)
    anchors = sample_anchors(loss, attn, 5, torch.Generator().manual_seed(2))
    res = dflash_objective(
        drafter, target, ids, loss, attn, feats, anchors=anchors, gamma=2.0, attn_backend="sdpa"
    )
    pos = anchors.positions
    block_ids = drafter.block_input_ids(ids.gather(1, pos))
    block_pos = (pos[:, :, None] + torch.arange(4)).flatten(1)
    hidden = drafter(feats, block_ids, block_pos, build_mask(pos, attn, 4, "sdpa"))
    logits = drafter.logits(hidden).view(2, -1, 4, 512)[:, :, 1:]
    labels, valid = block_labels(ids, loss, attn, anchors, 4)
    ce = F.cross_entropy(logits[valid], labels[valid], reduction="none")
    w = slot_weights(4, 2.0).expand_as(valid)[valid]
    torch.testing.assert_close(res.loss_sum, (ce * w).sum(), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(res.weight_sum, w.sum())
    assert int(res.n_pred) == int(valid.sum())
    assert int(res.n_correct) == int((logits[valid].argmax(-1) == labels[valid]).sum())
    assert res.pos_count.tolist() == valid.sum((0, 1)).tolist()


def test_streak_counts_leading_correct_supervised_slots() -> None:
    """Unsupervised slots neither break the streak nor count; a miss ends it."""
    correct = torch.tensor(
        [[True, True, False, True], [True, False, True, True], [False, True, True, True]]
    )
    valid = torch.tensor(
        [[True, True, True, True], [True, False, True, False], [True, True, True, True]]
    )
    assert streaks(correct, valid).tolist() == [2, 2, 0]


def test_no_nan_with_padded_and_anchorless_rows(target: TargetModel) -> None:
    """Rows without any eligible anchor (all padding blocks) give finite loss and grads."""
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch(rows=3)
    loss[2] = 0  # row 2: no supervised token -> only padded blocks
    feats = target.capture(ids, attn)
    for backend in ("sdpa",):
        drafter.zero_grad()
        res = dflash_objective(
            drafter,
            target,
            ids,
            loss,
            attn,
            feats,
            num_anchors=64,
            attn_backend=backend,
            generator=torch.Generator().manual_seed(0),
        )
        torch.autograd.backward(res.loss_sum)
        assert torch.isfinite(res.loss_sum)
        assert all(
            p.grad is not None and torch.isfinite(p.grad).all() for p in drafter.parameters()
        )
        assert int(res.n_blocks) == int(
            sample_anchors(loss, attn, 64, torch.Generator().manual_seed(0)).keep.sum()
        )


def test_batch_without_any_anchor_returns_zero_sums_that_backprop(target: TargetModel) -> None:
    """An all-prompt batch contributes nothing but still yields a graph (DDP needs one)."""
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch()
    loss.zero_()
    res = dflash_objective(drafter, target, ids, loss, attn, target.capture(ids, attn))
    torch.autograd.backward(res.loss_sum)
    assert float(res.loss_sum.detach()) == 0.0 and int(res.n_blocks) == 0


def test_sums_add_up_across_micro_batches(target: TargetModel) -> None:
    """Splitting rows into micro-batches gives the same sums (global normalisation is exact)."""
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch(rows=2, seq=32)
    feats = target.capture(ids, attn)
    anchors = sample_anchors(loss, attn, 6, torch.Generator().manual_seed(5))
    full = dflash_objective(drafter, target, ids, loss, attn, feats, anchors=anchors)
    parts = [
        dflash_objective(
            drafter,
            target,
            ids[r : r + 1],
            loss[r : r + 1],
            attn[r : r + 1],
            feats[r : r + 1],
            anchors=Anchors(anchors.positions[r : r + 1], anchors.keep[r : r + 1]),
        )
        for r in range(2)
    ]
    for name, value in full.metric_tensors().items():
        torch.testing.assert_close(
            value, sum(p.metric_tensors()[name] for p in parts), atol=1e-3, rtol=1e-5
        )


def test_noise_is_seeded_and_changes_the_loss(target: TargetModel) -> None:
    """Same generator seed, same noisy loss; noise=0 differs from noise>0."""
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch()
    feats = target.capture(ids, attn)

    def run(noise: float, seed: int) -> float:
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            return float(
                dflash_objective(
                    drafter, target, ids, loss, attn, feats, noise=noise, generator=g
                ).loss_sum
            )

    assert run(0.5, 1) == run(0.5, 1)
    assert run(0.5, 1) != run(0.0, 1)


def test_gamma_must_be_positive(target: TargetModel) -> None:
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch()
    with pytest.raises(ValueError, match="gamma"):
        dflash_objective(drafter, target, ids, loss, attn, target.capture(ids, attn), gamma=0.0)


def test_fp32_master_weights_under_bf16_autocast(target: TargetModel) -> None:
    """The pipeline's mixed precision: q, k, v stay in one dtype and the loss backprops."""
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch()
    feats = target.capture(ids, attn)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        res = dflash_objective(
            drafter, target, ids, loss, attn, feats, num_anchors=6, attn_backend="sdpa"
        )
    torch.autograd.backward(res.loss_sum.float())
    assert torch.isfinite(res.loss_sum.float())
    assert drafter.fc.weight.grad is not None and drafter.fc.weight.grad.dtype == torch.float32
