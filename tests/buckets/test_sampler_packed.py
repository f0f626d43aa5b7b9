"""The packed strategy: rows of several documents, shuffled every epoch, sharded and resumable."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.bucketing.compare import measure
from trainer.config import ConfigError, TrainConfig
from trainer.data.lengths import seed_shaped_lengths
from trainer.pipeline.plan import BatchPlan
from trainer.sampler import BatchSampler, SamplerError, pack_rows

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def packed_configs(draw: st.DrawFn) -> dict[str, Any]:
    n = draw(st.integers(1, 300))
    lengths = draw(st.lists(st.integers(1, 300), min_size=n, max_size=n))
    row_length = draw(st.integers(max(lengths), 600))
    return {
        "lengths": np.array(lengths),
        "strategy": "packed",
        "row_length": row_length,
        "token_budget": draw(st.integers(row_length, 3000)),
        "max_batch": draw(st.integers(1, 24)),
        "seed": draw(st.integers(0, 2**32)),
        "world_size": draw(st.integers(1, min(4, n))),
    }


@given(packed_configs())
@FAST
def test_rows_hold_each_sample_once_within_row_length_budget_and_max_batch(
    cfg: dict[str, Any],
) -> None:
    """Every sample once per epoch over all ranks (minus reported drops); a row never exceeds
    row_length, a batch never holds more than token_budget // row_length rows or max_batch
    documents, and the batch's accounting (max_len, real, padded) is that of its rows."""
    samplers = [BatchSampler(**cfg, rank=r) for r in range(cfg["world_size"])]
    x, rl = cfg["lengths"], cfg["row_length"]
    for epoch in (0, 1):
        per_rank = [s.epoch_batches(epoch) for s in samplers]
        assert len({len(b) for b in per_rank}) == 1
        seen = np.concatenate([b.indices for bs in per_rank for b in bs])
        dropped = samplers[0].dropped(epoch)
        assert sorted([*seen.tolist(), *dropped.tolist()]) == list(range(len(x)))
        assert len(dropped) < cfg["world_size"]
        for b in (b for bs in per_rank for b in bs):
            assert b.row_sizes is not None and int(b.row_sizes.sum()) == len(b.indices)
            fills = [int(x[r].sum()) for r in b.rows()]
            assert all(len(r) >= 1 for r in b.rows()) and max(fills) <= rl
            assert b.num_rows * rl <= cfg["token_budget"]
            assert len(b.indices) <= cfg["max_batch"]
            assert (b.max_len, b.real_tokens) == (max(fills), int(x[b.indices].sum()))
            assert b.padded_tokens == b.num_rows * max(fills) and b.bucket == 0


@given(packed_configs())
@FAST
def test_drops_only_when_every_batch_is_one_document(cfg: dict[str, Any]) -> None:
    s = BatchSampler(**cfg)
    if len(s.dropped(0)):
        assert all(len(b.indices) == 1 for g in s.global_batches(0) for b in g)


@given(packed_configs(), st.integers(0, 80))
@FAST
def test_packed_epochs_are_pure_and_resume_through_the_plan_state(
    cfg: dict[str, Any], taken: int
) -> None:
    """Independent samplers agree row for row; a plan restored from a JSON state continues
    exactly where the uninterrupted one is."""
    np.random.seed(taken)  # global state must not matter
    a = BatchSampler(**cfg).epoch_batches(1)
    b = BatchSampler(**cfg).epoch_batches(1)
    assert [[r.tolist() for r in x.rows()] for x in a] == [
        [r.tolist() for r in y.rows()] for y in b
    ]
    epochs = 1
    while (first := BatchPlan(BatchSampler(**cfg), epochs)).total < taken + 10:
        epochs *= 2
    expected = [first.batch(s) for s in range(taken, taken + 10)]
    state = json.loads(json.dumps(first.state_dict(taken)))
    second = BatchPlan(BatchSampler(**cfg), epochs)
    seq = second.load_state_dict(state)
    got = [second.batch(s) for s in range(seq, seq + 10)]
    assert [g.indices.tolist() for g in got] == [e.indices.tolist() for e in expected]
    assert [g.row_sizes.tolist() for g in got if g.row_sizes is not None] == [
        e.row_sizes.tolist() for e in expected if e.row_sizes is not None
    ]


def test_held_out_rows_never_enter_a_row() -> None:
    x = np.random.default_rng(0).integers(4, 64, size=400)
    held = np.arange(0, 400, 7)
    s = BatchSampler(
        x, strategy="packed", token_budget=256, max_batch=8, seed=3, world_size=2, exclude=held
    )
    for epoch in (0, 1):
        ids = np.concatenate([b.indices for g in s.global_batches(epoch) for b in g])
        assert not set(ids.tolist()) & set(held.tolist())
        assert len(ids) + len(s.dropped(epoch)) == 400 - len(held)


def tiny_lengths() -> np.ndarray:
    """The tiny CPU config's shape: the seed's lengths at 1/32 scale (what the synthetic store
    uses with length_scale 32)."""
    lengths: np.ndarray = np.maximum(1, seed_shaped_lengths(3000) // 32)
    return lengths


def test_rows_fill_and_pairs_do_not_repeat_across_epochs() -> None:
    """The goal of packing: rows ~97 % full (first-fit over a few open rows) with full-shuffle
    diversity: <= 1 % of co-batched pairs repeat next epoch (compare's measure), where sorted
    repeats all of them; on the seed's own lengths and row length too."""
    kw: dict[str, Any] = {"token_budget": 1024, "max_batch": 16, "seed": 0}
    packed = measure(BatchSampler(tiny_lengths(), strategy="packed", **kw), 3)
    assert packed.padding_efficiency > 0.97
    assert packed.pair_repeat is not None and packed.pair_repeat <= 0.01
    assert measure(BatchSampler(tiny_lengths(), strategy="sorted", **kw), 2).pair_repeat == 1.0
    x = seed_shaped_lengths(50_000)
    s = BatchSampler(x, strategy="packed", token_budget=49_152, max_batch=64, seed=0)
    batches = s.epoch_batches(0)
    rows = sum(b.num_rows for b in batches)
    assert s.row_length == int(x.max())
    assert int(x.sum()) / (rows * s.row_length) > 0.96  # row fill (row_length = longest, 8191)
    assert max(b.padded_tokens for b in batches) <= 49_152


def test_pack_rows_is_first_fit_over_the_open_rows() -> None:
    """Worked case, row 10, 2 open rows: 6 opens r0, 6 opens r1, 3 -> r0, 5 closes r0 and opens
    r2, 4 -> r1 (full: closes), 1 -> r2."""
    order, sizes = pack_rows(np.array([6, 6, 3, 5, 4, 1]), 10, 2, 8)
    rows = np.split(order, np.cumsum(sizes)[:-1])
    assert [r.tolist() for r in rows] == [[0, 2], [1, 4], [3, 5]]
    order, sizes = pack_rows(np.array([1, 1, 1, 1, 1]), 10, 2, 2)  # max_docs closes a row
    assert sizes.tolist() == [2, 2, 1]


def test_exact_packed_batches_under_a_fixed_seed_are_stable() -> None:
    """Pinned output: guards cross-machine and cross-release determinism of the packed epoch."""
    s = BatchSampler(
        [5, 9, 3, 7, 2, 8, 6, 4, 1, 10], strategy="packed", token_budget=20, max_batch=4, seed=7
    )
    got = [[r.tolist() for r in b.rows()] for b in s.epoch_batches(0)]
    assert got == GOLDEN_PACKED_SEED7
    assert s.row_length == 10


GOLDEN_PACKED_SEED7 = [[[6, 2], [1]], [[9], [8, 7, 0]], [[4, 3], [5]]]


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"row_length": 100}, r"row_length 100 is shorter than sample 2 \(300 tokens\)"),
        ({"row_length": 5000}, "row_length 5000 is more than token_budget 4096"),
        ({"row_length": 0}, "row_length must be an integer >= 1"),
    ],
)
def test_bad_row_lengths_are_named(kwargs: dict[str, Any], needle: str) -> None:
    with pytest.raises(SamplerError, match=needle):
        BatchSampler(
            [10, 20, 300], strategy="packed", token_budget=4096, max_batch=8, seed=0, **kwargs
        )


def test_row_length_is_in_the_fingerprint_and_only_for_packed() -> None:
    """A resume across a row_length change is refused naming it; the other strategies'
    fingerprints do not carry it (their older checkpoints still resume)."""
    x = tiny_lengths()
    kw: dict[str, Any] = {"strategy": "packed", "token_budget": 1024, "max_batch": 16, "seed": 0}
    a = BatchSampler(x, row_length=300, **kw)
    b = BatchSampler(x, row_length=400, **kw)
    saved = BatchPlan(a, 1).state_dict(3)
    with pytest.raises(SamplerError, match="row_length is 300 in the saved state but 400"):
        BatchPlan(b, 1).load_state_dict(saved)
    other = BatchSampler(x, strategy="random", token_budget=1024, max_batch=16, seed=0)
    assert "row_length" not in other.fingerprint_config


def _tiny_raw(**batching: Any) -> dict[str, Any]:
    base = {"strategy": "packed", "token_budget": 1024, "max_batch": 16}
    return {
        "data": {"store": "s"},
        "batching": base | batching,
        "model": {"target_dir": "t", "mask_token_id": 63},
    }


@pytest.mark.parametrize(
    ("batching", "needle"),
    [
        ({"row_length": 2000}, "batching.row_length: .*2000 is more than token_budget 1024"),
        ({"strategy": "sorted", "row_length": 100}, "batching.row_length: .*'packed' only"),
        ({"row_length": 0}, "batching.row_length: "),
    ],
)
def test_config_row_length_errors_are_one_line_naming_the_key(
    batching: dict[str, Any], needle: str
) -> None:
    with pytest.raises(ConfigError, match=needle) as err:
        TrainConfig.from_dict(_tiny_raw(**batching))
    assert "\n" not in str(err.value)
    assert TrainConfig.from_dict(_tiny_raw(row_length=512)).batching.row_length == 512
