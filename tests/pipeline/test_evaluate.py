"""The in-training evaluator against the project's proven references: real greedy speculative
decoding (tau), the teacher-forced streaks of the training path (acc@k) and the objective (loss)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.model.helpers import MASK_ID, make_drafter
from trainer.model.drafter import DFlashDrafter
from trainer.model.fit import Row, fit, greedy_continuations, pad_rows, teacher_forced_streaks
from trainer.model.objective import dflash_objective
from trainer.model.speculative import speculative_generate
from trainer.model.target import TargetModel
from trainer.model.tiny import build_tiny_target
from trainer.pipeline.evaluate import (
    HeldOutBatch,
    eligible_anchors,
    evaluate,
    supervised_spans,
)

BLOCK, NEW = 4, 24


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TargetModel]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield TargetModel.load(build_tiny_target(tmp_path_factory.mktemp("tiny"), seed=0), [1, 5])
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def trained(target: TargetModel) -> tuple[DFlashDrafter, list[Row], list[int]]:
    """A drafter fitted on the target's greedy text, and held-out greedy rows whose prompts
    have two lengths (so batches pad): prompt + NEW + B-1 generated, supervised tokens."""
    gen = torch.Generator().manual_seed(0)
    rows = greedy_continuations(target, torch.randint(0, 500, (512, 8), generator=gen), 32)
    drafter = make_drafter(target, block_size=BLOCK, num_layers=2)
    fit(drafter, target, rows, steps=100, lr=1e-2, batch_size=16, num_anchors=8)
    held, prompts = [], []
    for plen in (8, 13):
        p = torch.randint(0, 500, (3, plen), generator=gen)
        held += greedy_continuations(target, p, NEW + BLOCK - 1)
        prompts += [plen] * 3
    return drafter, held, prompts


def _batches(target: TargetModel, rows: list[Row], size: int) -> list[HeldOutBatch]:
    out = []
    for i in range(0, len(rows), size):
        ids, lm, attn = pad_rows(rows[i : i + size])
        out.append(HeldOutBatch(ids, lm.to(torch.uint8), attn, target.capture(ids, attn)))
    return out


@pytest.mark.parametrize("max_query_rows", [None, 12])
def test_simulated_tau_equals_real_speculative_tau(
    target: TargetModel,
    trained: tuple[DFlashDrafter, list[Row], list[int]],
    max_query_rows: int | None,
) -> None:
    """On the target's own greedy text, the eval's walk tau is the real loop's tau, per row and
    in the mean, batched and padded, in one piece or in pieces of 12 query rows."""
    drafter, held, prompts = trained
    real = [
        speculative_generate(target, drafter, r.ids[:plen], NEW)
        for r, plen in zip(held, prompts, strict=True)
    ]
    assert all(s.tokens == r.ids[p : p + NEW] for s, r, p in zip(real, held, prompts, strict=True))
    real_tau = sum(s.tau for s in real) / len(real)
    assert real_tau > 1.3  # trained: the equality is not the trivial all-1.0 one
    res = evaluate(drafter, _batches(target, held, 4), gamma=None, max_query_rows=max_query_rows)
    assert res.spans == len(held) and res.rows == len(held)
    assert res.tau == pytest.approx(real_tau, abs=1e-12)
    for r, s in zip(held, real, strict=True):  # one row at a time: the per-row tau too
        one = evaluate(drafter, _batches(target, [r], 1), gamma=None, max_query_rows=None)
        assert one.tau == pytest.approx(s.tau, abs=1e-12)


def test_untrained_drafter_has_tau_one(
    target: TargetModel, trained: tuple[DFlashDrafter, list[Row], list[int]]
) -> None:
    _, held, _ = trained
    fresh = make_drafter(target, block_size=BLOCK, num_layers=2, seed=3)
    res = evaluate(fresh, _batches(target, held, 6), gamma=None, max_query_rows=None)
    assert res.tau == 1.0 and res.acc_at[0] < 0.05


def test_acc_at_k_and_loss_match_the_training_path(
    target: TargetModel, trained: tuple[DFlashDrafter, list[Row], list[int]]
) -> None:
    """acc@k from the teacher-forced streaks of `trainer.model.fit` at every eligible anchor;
    loss/acc from the training objective with those anchors; tau_exp = 1 + sum(acc@k)."""
    drafter, held, _ = trained
    batches = _batches(target, held, 4)
    res = evaluate(drafter, batches, gamma=None, max_query_rows=7)
    num = [0] * (BLOCK - 1)
    den = [0] * (BLOCK - 1)
    for r in held:
        streak = teacher_forced_streaks(drafter, target, r)
        sup = r.loss_mask
        for a in range(len(r.ids) - 1):
            if not (sup[a] and sup[a + 1]):
                continue
            for k in range(1, BLOCK):
                if a + k < len(r.ids) and sup[a + k]:
                    den[k - 1] += 1
                    num[k - 1] += int(streak[a]) >= k
    assert res.acc_at == pytest.approx([n / d for n, d in zip(num, den, strict=True)], abs=1e-12)
    assert res.acc_at == sorted(res.acc_at, reverse=True)
    assert res.tau_exp == pytest.approx(1 + sum(res.acc_at))
    assert res.blocks == sum(len(r.ids) - p - 1 for r, p in zip(held, trained[2], strict=True))
    loss = weight = correct = pred = 0.0
    with torch.no_grad():
        for b in batches:
            out = dflash_objective(
                drafter,
                target,
                b.input_ids,
                b.loss_mask,
                b.attention_mask,
                b.hidden,
                anchors=eligible_anchors(b.loss_mask, b.attention_mask),
            )
            loss += float(out.loss_sum)
            weight += float(out.weight_sum)
            correct += float(out.n_correct)
            pred += float(out.n_pred)
    assert res.loss == pytest.approx(loss / weight, rel=1e-5)
    assert res.acc == pytest.approx(correct / pred, abs=1e-12)


def test_spans_and_eligible_anchors_of_multi_turn_rows() -> None:
    lm = torch.tensor([[0, 0, 1, 1, 1, 0, 1, 1, 0], [0, 1, 1, 1, 1, 1, 1, 1, 1]])
    attn = torch.ones_like(lm)
    attn[0, 8] = 0
    assert supervised_spans(lm, attn) == [[(2, 5), (6, 8)], [(1, 9)]]
    anchors = eligible_anchors(lm, attn)
    got = [anchors.positions[r][anchors.keep[r]].tolist() for r in range(2)]
    assert got == [[2, 3, 6], [1, 2, 3, 4, 5, 6, 7]]


def test_evaluation_draws_no_random_numbers_and_restores_train_mode(
    target: TargetModel, trained: tuple[DFlashDrafter, list[Row], list[int]]
) -> None:
    drafter, held, _ = trained
    drafter.train()
    state = torch.get_rng_state()
    evaluate(drafter, _batches(target, held, 6), gamma=None, max_query_rows=None)
    assert torch.equal(torch.get_rng_state(), state) and drafter.training
    assert MASK_ID not in {t for r in held for t in r.ids}
