"""BatchSampler: budget safety, coverage, determinism, resume and sharding, on real lengths."""

from __future__ import annotations

import itertools
import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.config import STRATEGIES, Strategy
from trainer.data.lengths import seed_shaped_lengths
from trainer.pipeline.plan import BatchPlan, Position
from trainer.sampler import BatchSampler, SamplerError, greedy_batch_sizes

# Generated configs include pool-sort pools larger than the data: legal, warned, tested in test_cli.
pytestmark = pytest.mark.filterwarnings("ignore::trainer.sampler.SamplerWarning")

SEED_BOUNDS = [65, 770, 1216, 1728, 2432, 3296, 8192]
FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def naive_greedy(ordered: list[int], segment: list[int], budget: int, max_batch: int) -> list[int]:
    """The packing rule spelled out one sample at a time (the reference for the vector version)."""
    sizes: list[int] = []
    size, longest = 0, 0
    for i, x in enumerate(ordered):
        fits = size < max_batch and (size + 1) * max(longest, x) <= budget
        if size and (not fits or segment[i] != segment[i - 1]):
            sizes.append(size)
            size, longest = 0, 0
        size, longest = size + 1, max(longest, x)
    return [*sizes, size] if size else sizes


@st.composite
def configs(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(1, 500), min_size=n, max_size=n))
    budget = draw(st.integers(max(lengths), 3000))
    cuts = draw(st.lists(st.integers(2, 500), max_size=4, unique=True))
    world = draw(st.integers(1, min(4, n)))
    return {
        "lengths": np.array(lengths),
        "strategy": draw(st.sampled_from(STRATEGIES)),
        "boundaries": [1, *sorted(cuts), 501],
        "token_budget": budget,
        "max_batch": draw(st.integers(1, 16)),
        "seed": draw(st.integers(0, 2**32)),
        "world_size": world,
        "pool_size": draw(st.integers(1, 64)),
    }


def ranks(cfg: dict[str, Any]) -> list[BatchSampler]:
    return [BatchSampler(**cfg, rank=r) for r in range(cfg["world_size"])]


@given(st.data())
@FAST
def test_vector_greedy_packer_equals_the_one_at_a_time_rule(data: st.DataObject) -> None:
    """greedy_batch_sizes cuts exactly where the sequential fairseq-style rule cuts."""
    xs = data.draw(st.lists(st.integers(1, 400), min_size=1, max_size=200))
    seg = sorted(data.draw(st.lists(st.integers(0, 3), min_size=len(xs), max_size=len(xs))))
    budget = data.draw(st.integers(max(xs), 2500))
    mb = data.draw(st.integers(1, 20))
    got = greedy_batch_sizes(np.array(xs), np.array(seg), budget, mb).tolist()
    assert got == naive_greedy(xs, seg, budget, mb)


@given(configs())
@FAST
def test_every_sample_once_per_epoch_across_ranks_and_never_over_budget(
    cfg: dict[str, Any],
) -> None:
    """Union over ranks is every sample exactly once (minus reported drops); no batch over T or B."""
    samplers = ranks(cfg)
    for epoch in (0, 1):
        per_rank = [s.epoch_batches(epoch) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1  # equal step counts
        seen = np.concatenate([b.indices for bs in per_rank for b in bs])
        dropped = samplers[0].dropped(epoch)
        assert len(np.unique(seen)) == len(seen)  # disjoint shards, no repeats
        assert sorted([*seen.tolist(), *dropped.tolist()]) == list(range(len(cfg["lengths"])))
        assert len(dropped) < cfg["world_size"]
        for b in itertools.chain.from_iterable(per_rank):
            ls = cfg["lengths"][b.indices]
            fills = [cfg["lengths"][r].sum() for r in b.rows()]  # one sample a row unless packed
            assert len(fills) * max(fills) <= cfg["token_budget"]
            assert 1 <= len(b.indices) <= cfg["max_batch"]
            assert (b.max_len, b.real_tokens) == (max(fills), ls.sum())


@given(configs())
@FAST
def test_drops_happen_only_when_every_batch_is_a_single_sample(cfg: dict[str, Any]) -> None:
    """Equal shares are made by splitting batches; dropping is the last resort."""
    s = BatchSampler(**cfg)
    if len(s.dropped(0)):
        assert all(len(b.indices) == 1 for g in s.global_batches(0) for b in g)


@given(configs(), st.integers(0, 3))
@FAST
def test_same_seed_and_epoch_give_the_same_batches(cfg: dict[str, Any], epoch: int) -> None:
    """Two independent samplers agree batch for batch (no hidden global RNG)."""
    np.random.seed(epoch)  # global state must not matter
    a = BatchSampler(**cfg).epoch_batches(epoch)
    np.random.seed(epoch + 99)
    b = BatchSampler(**cfg).epoch_batches(epoch)
    assert [x.indices.tolist() for x in a] == [y.indices.tolist() for y in b]


def plan_of(cfg: dict[str, Any], micro_batches: int) -> BatchPlan:
    """A plan of whole epochs holding at least `micro_batches`."""
    epochs = 1
    while (plan := BatchPlan(BatchSampler(**cfg), epochs)).total < micro_batches:
        epochs *= 2
    return plan


@given(configs(), st.integers(0, 120))
@FAST
def test_resume_from_state_dict_continues_identically(cfg: dict[str, Any], taken: int) -> None:
    """Take k, save, restore into a fresh plan: the next batches equal the uninterrupted run."""
    first = plan_of(cfg, taken + 25)
    uninterrupted = [
        b.indices.tolist()
        for e in range(len(first.steps))
        for b in BatchSampler(**cfg).epoch_batches(e)
    ]
    taken_batches = [first.batch(seq).indices.tolist() for seq in range(taken)]
    assert taken_batches == uninterrupted[:taken]
    state = json.loads(json.dumps(first.state_dict(taken)))  # must survive a JSON checkpoint
    expected = uninterrupted[taken : taken + 25]
    second = BatchPlan(BatchSampler(**cfg), len(first.steps))
    seq = second.load_state_dict(state)
    assert [second.batch(s).indices.tolist() for s in range(seq, seq + 25)] == expected


def test_position_counts_batches_and_rolls_into_the_next_epoch() -> None:
    """position is (epoch, batches handed out) and the sequence crosses epochs by itself."""
    s = BatchSampler(np.arange(1, 41), token_budget=80, max_batch=4, seed=3)
    steps = s.steps_per_epoch(0)
    plan = BatchPlan(s, 2)
    assert plan.locate(steps - 1) == Position(0, steps - 1)
    nxt = plan.batch(steps)
    assert plan.locate(steps) == Position(1, 0)
    assert nxt.indices.tolist() == s.epoch_batches(1)[0].indices.tolist()
    assert (plan.state_dict(steps + 1)["epoch"], plan.state_dict(steps + 1)["position"]) == (1, 1)


def test_state_can_record_the_trained_position_behind_a_prefetcher() -> None:
    """A pipeline that pulled ahead saves the position it trained to and resumes from there."""
    plan = BatchPlan(BatchSampler(np.arange(1, 200), token_budget=400, max_batch=8, seed=2), 1)
    pulled = [plan.batch(seq) for seq in range(10)]  # 10 prefetched, only 6 trained
    state = plan.state_dict(6)
    fresh = BatchPlan(BatchSampler(np.arange(1, 200), token_budget=400, max_batch=8, seed=2), 1)
    assert fresh.batch(fresh.load_state_dict(state)).indices.tolist() == pulled[6].indices.tolist()


def test_mismatched_state_is_refused_naming_the_setting() -> None:
    """A state from another budget or other data is refused, with the differing key named."""
    x = seed_shaped_lengths(5000)
    a = BatchSampler(x, boundaries=SEED_BOUNDS, token_budget=49_152, max_batch=64, seed=0)
    b = BatchSampler(x, boundaries=SEED_BOUNDS, token_budget=32_768, max_batch=64, seed=0)
    saved = BatchPlan(a, 1).state_dict(0)
    with pytest.raises(SamplerError, match="token_budget is 49152 in the saved state but 32768"):
        BatchPlan(b, 1).load_state_dict(saved)
    c = BatchSampler(x[:-1], boundaries=SEED_BOUNDS, token_budget=49_152, max_batch=64, seed=0)
    with pytest.raises(SamplerError, match="lengths_sha256"):
        BatchPlan(c, 1).load_state_dict(saved)
    state = saved | {"position": 10**9}
    with pytest.raises(SamplerError, match="out of range"):
        BatchPlan(a, 1).load_state_dict(state)


def test_a_sample_longer_than_the_budget_is_refused_at_construction() -> None:
    """No batch can hold it, so the sampler names the sample and the budget up front."""
    with pytest.raises(SamplerError, match="sample 2 has 9000 tokens, more than token_budget 8192"):
        BatchSampler([10, 20, 9000], token_budget=8192, max_batch=8, seed=0)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"boundaries": [100, 8192]}, r"sample \d+ \(length 65\) lies outside boundaries"),
        ({"boundaries": [65, 500, 400, 8192]}, "strictly increasing"),
        ({"strategy": "shuffle"}, "strategy must be one of"),
        ({"max_batch": 0}, "max_batch must be an integer >= 1"),
        ({"rank": 2, "world_size": 2}, r"rank must be in \[0, 2\)"),
        ({"seed": -1}, "seed must be"),
    ],
)
def test_bad_arguments_are_named(kwargs: dict[str, Any], needle: str) -> None:
    """Each invalid argument produces a one-line error naming it."""
    base: dict[str, Any] = {
        "boundaries": SEED_BOUNDS,
        "token_budget": 49_152,
        "max_batch": 64,
        "seed": 0,
    }
    with pytest.raises(SamplerError, match=needle):
        BatchSampler(seed_shaped_lengths(2000), **(base | kwargs))


def test_ranks_of_a_step_share_a_bucket_except_for_the_few_leftover_groups() -> None:
    """world_size batches per step come from one bucket; only leftovers (< K groups) mix."""
    x = seed_shaped_lengths(40_000)
    s = BatchSampler(
        x, boundaries=SEED_BOUNDS, token_budget=49_152, max_batch=64, seed=1, world_size=8
    )
    groups = s.global_batches(0)
    mixed = sum(len({b.bucket for b in g}) > 1 for g in groups)
    assert mixed <= len(SEED_BOUNDS) - 1
    assert len(groups) > 200


def test_bucketed_composition_changes_each_epoch_but_sorted_stays_static() -> None:
    """The seed's complaint: sorted batches never change composition; bucketed ones do."""
    x = seed_shaped_lengths(20_000)

    def pairs(s: BatchSampler, epoch: int) -> set[frozenset[int]]:
        return {frozenset(b.indices.tolist()) for b in s.epoch_batches(epoch)}

    kw: dict[str, Any] = {"token_budget": 49_152, "max_batch": 64, "seed": 0}
    srt = BatchSampler(x, strategy="sorted", **kw)
    assert pairs(srt, 0) == pairs(srt, 1)
    assert [b.indices.tolist() for b in srt.epoch_batches(0)] != [
        b.indices.tolist() for b in srt.epoch_batches(1)
    ]  # order still shuffles
    bkt = BatchSampler(x, boundaries=SEED_BOUNDS, **kw)
    assert len(pairs(bkt, 0) & pairs(bkt, 1)) < 0.01 * len(pairs(bkt, 0))


def test_exact_batches_under_a_fixed_seed_are_stable() -> None:
    """Pinned output for seed 7: guards cross-machine and cross-release determinism."""
    s = BatchSampler(
        [5, 9, 3, 7, 2, 8, 6, 4, 1, 10], boundaries=[1, 5, 11], token_budget=20, max_batch=3, seed=7
    )
    got = [b.indices.tolist() for b in s.epoch_batches(0)]
    assert got == GOLDEN_SEED7
    assert sorted(itertools.chain.from_iterable(got)) == list(range(10))


GOLDEN_SEED7 = [[7], [0, 5], [6, 3], [2, 4, 8], [9, 1]]


@pytest.mark.parametrize("strategy", ["sorted", "random", "packed"])
@pytest.mark.parametrize("n", [4, 7, 13])
def test_equal_shares_split_halves_again_before_dropping_anything(
    strategy: Strategy, n: int
) -> None:
    """One batch holding all n >= 4 samples, 4 ranks: halves are split again (largest first)
    until the count is a multiple of 4, so nothing is dropped. The halves split off were once
    never split again: 4 samples in one batch became [1], [1], [2], and all of them were
    dropped (fewer than 4 samples is refused up front, in one line)."""
    lengths = np.ones(n, dtype=np.int64)
    kw: dict[str, Any] = {"row_length": 1} if strategy == "packed" else {}
    samplers = [
        BatchSampler(
            lengths,
            strategy=strategy,
            token_budget=n,
            max_batch=n,
            seed=0,
            world_size=4,
            rank=r,
            **kw,
        )
        for r in range(4)
    ]
    batches = [b for s in samplers for b in s.epoch_batches(0)]
    dropped = samplers[0].dropped(0).tolist()
    assert dropped == []
    assert sorted(i for b in batches for i in b.indices.tolist()) == list(range(n))
    assert len(batches) == 4 * samplers[0].steps_per_epoch(0)
