"""The step-cost model (issue 14 item 2): the fit, the calibration file, the time objective of
the planner (`plan --objective time`), and the features it is fitted on. Torch-free."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from trainer.bucketing.dp import make_grid, reference_segment_costs, segment_stats
from trainer.bucketing.estimate import estimate_bucket
from trainer.bucketing.timecost import (
    FEATURES,
    CalibrationError,
    StepCostModel,
    batch_features,
    eligible_counts,
    fit_step_cost,
    nnls,
    segment_times,
)
from trainer.buckets import main, plan_buckets
from trainer.data.lengths import seed_shaped_lengths
from trainer.sampler import Batch, BatchSampler

TRUE = {
    "padded_tokens": 2e-6,
    "padded_sq": 3e-9,
    "anchor_blocks": 5e-5,
    "samples": 1e-4,
    "batches": 4e-3,
}


def model(**coef: float) -> StepCostModel:
    full = {k: coef.get(k, 0.0) for k in FEATURES}
    return StepCostModel(full, 1.0, 10, 8.0, {"note": "test"})


def test_nnls_matches_least_squares_when_the_optimum_is_positive_and_clips_otherwise() -> None:
    rng = np.random.default_rng(0)
    a = rng.random((40, 4))
    x_true = np.array([1.0, 2.0, 0.5, 3.0])
    b = a @ x_true
    assert np.allclose(nnls(a, b), x_true, rtol=1e-8)
    # a target that wants a negative weight: NNLS sets it to 0 and is optimal over x >= 0
    b2 = a @ np.array([1.0, -2.0, 0.5, 3.0])
    x = nnls(a, b2)
    assert (x >= 0).all() and x[1] == 0.0
    best = np.linalg.norm(a @ x - b2)
    for _ in range(200):  # no non-negative point nearby does better
        y = np.maximum(x + rng.normal(0, 0.05, 4), 0)
        assert np.linalg.norm(a @ y - b2) >= best - 1e-12


def test_the_fit_recovers_known_coefficients_from_window_timings() -> None:
    """Windows of 8 batches drawn from three strategies' batch shapes, timed by a known model
    plus 1 % noise: the fit gets every coefficient back within a few percent, R^2 ~ 1."""
    rng = np.random.default_rng(1)
    x = seed_shaped_lengths(4000, seed=3) // 32 + 3
    elig = np.maximum(x - 10, 0)
    rows = []
    for strategy in ("sorted", "random", "bucketed"):
        s = BatchSampler(
            x,
            strategy=strategy,
            boundaries=[3, 40, 70, 110, int(x.max()) + 1],
            token_budget=1024,
            max_batch=16,
            seed=0,
        )
        f = np.stack([batch_features(b, elig, 8) for b in s.epoch_batches(0)])
        rows += [f[i : i + 8].sum(0) for i in range(0, len(f) - 8, 8)]
    feats = np.stack(rows)
    true = np.array([TRUE[k] for k in FEATURES])
    secs = feats @ true * (1 + rng.normal(0, 0.01, len(feats)))
    coef, r2 = fit_step_cost(feats, secs)
    assert r2 > 0.98
    pred = feats @ np.array([coef[k] for k in FEATURES])
    assert np.abs(pred / secs - 1).max() < 0.05
    assert all(v >= 0 for v in coef.values())
    with pytest.raises(CalibrationError, match="at least 2"):
        fit_step_cost(feats[:1], secs[:1])


def test_eligible_counts_follow_the_objectives_rule_per_row() -> None:
    """Position a is eligible iff it and a+1 are supervised, inside the same row."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 30, 500)
    offsets = np.concatenate(([0], np.cumsum(lengths))).astype(np.int64)
    mask = (rng.random(int(offsets[-1])) < 0.7).astype(np.uint8)
    want = [
        sum(1 for a in range(lo, hi - 1) if mask[a] and mask[a + 1])
        for lo, hi in itertools.pairwise(offsets.tolist())
    ]
    assert eligible_counts(mask, offsets, chunk_rows=37).tolist() == want


def test_batch_features_padded_and_packed() -> None:
    elig = np.array([3, 20, 5, 0, 9])
    padded = Batch(np.array([0, 1, 2]), 0, 40, 90)
    f = batch_features(padded, elig, 8)
    # 3 rows of 40; every row draws min(8, most eligible = 20) = 8 blocks (padded anchors)
    assert f.tolist() == [120.0, 3 * 1600.0, 24.0, 3.0, 1.0]
    packed = Batch(np.array([0, 1, 2, 3, 4]), 0, 50, 95, row_sizes=np.array([3, 2]))
    f = batch_features(packed, elig, 8)
    # 2 rows of 50; each document draws min(8, its eligible)
    assert f.tolist() == [100.0, 2 * 2500.0, 3 + 8 + 5 + 0 + 8, 5.0, 1.0]
    # a target attending per document: the attention term is the documents' own lengths^2
    lengths = np.array([10, 20, 15, 30, 20])
    f = batch_features(packed, elig, 8, lengths)
    assert f.tolist() == [100.0, 100 + 400 + 225 + 900 + 400, 24.0, 5.0, 1.0]
    assert batch_features(padded, elig, 8, lengths).tolist() == [120.0, 4800.0, 24.0, 3.0, 1.0]


def test_segment_stats_batches_equal_the_one_segment_estimator() -> None:
    x = seed_shaped_lengths(3000, seed=5) // 64 + 2
    grid = make_grid(x)
    cost, counts, batches = segment_stats(grid, 1024, 16)
    ref = reference_segment_costs(grid, 1024, 16)
    assert np.allclose(cost[np.isfinite(ref)], ref[np.isfinite(ref)], rtol=1e-9)
    n_e = len(grid.edges)
    for i, j in [(0, n_e - 1), (0, n_e // 2), (n_e // 3, n_e - 1), (2, 9)]:
        a, b = grid.bin_of_edge[i], grid.bin_of_edge[j]
        est = estimate_bucket(grid.rep[a:b], grid.count[a:b], 1024, 16)
        assert batches[i, j] == pytest.approx(est.batches, rel=1e-9)
        assert counts[i, j] == est.count


def test_a_padding_only_model_plans_what_the_padding_objective_plans() -> None:
    x = seed_shaped_lengths(3000, seed=6) // 32 + 3
    pad = plan_buckets(x, 4, 1024, 16, simulate=False)
    timed = plan_buckets(x, 4, 1024, 16, simulate=False, cost_model=model(padded_tokens=1e-6))
    assert timed.boundaries == pad.boundaries
    assert timed.objective == "time" and timed.rates is not None
    padded = sum(b.tokens / b.predicted_efficiency for b in timed.buckets)
    assert timed.rates.predicted_epoch_s == pytest.approx(1e-6 * padded, rel=1e-9)
    assert timed.rates.predicted_tokens_s == pytest.approx(timed.total_tokens / (1e-6 * padded))


def test_the_time_objective_is_optimal_under_its_model() -> None:
    """With a per-batch cost the time plan's predicted time is no worse than the padding
    plan's (each scored by the same segment model), and it trades padding for fewer batches."""
    x = seed_shaped_lengths(3000, seed=7) // 32 + 3
    m = model(padded_tokens=1e-6, padded_sq=2e-9, samples=1e-5, batches=5e-3)
    pad = plan_buckets(x, 4, 1024, 16, simulate=False)
    timed = plan_buckets(x, 4, 1024, 16, simulate=False, cost_model=m)

    def seconds(edges: list[int]) -> float:
        grid = make_grid(x, extra_edges=edges)
        cost, counts, batches = segment_stats(grid, 1024, 16)
        t = segment_times(m, cost, counts.astype(np.float64), batches)
        idx = [int(np.searchsorted(grid.edges, e)) for e in edges]
        return float(sum(t[a, b] for a, b in itertools.pairwise(idx)))

    assert seconds(timed.boundaries) <= seconds(pad.boundaries) * (1 + 1e-12)
    assert timed.rates is not None
    assert timed.rates.predicted_epoch_s == pytest.approx(seconds(timed.boundaries), rel=1e-9)


def test_calibration_round_trip_and_one_line_errors(tmp_path: Path) -> None:
    m = model(**TRUE)
    path = m.save(tmp_path / "cal.json")
    back = StepCostModel.load(path)
    assert back == m
    d = json.loads(path.read_text())
    for key, value, needle in [
        ("coef", {**d["coef"], "padded_sq": -1.0}, "coef.padded_sq must be >= 0"),
        ("coef", {k: v for k, v in d["coef"].items() if k != "batches"}, "coef.batches"),
        ("version", 7, "version 7"),
        ("r2", "high", "r2 must be a finite number"),
    ]:
        (tmp_path / "bad.json").write_text(json.dumps({**d, key: value}))
        with pytest.raises(CalibrationError, match=needle.replace(".", r"\.")):
            StepCostModel.load(tmp_path / "bad.json")
    with pytest.raises(CalibrationError, match="cannot read"):
        StepCostModel.load(tmp_path / "missing.json")


def test_plan_objective_time_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, seed_shaped_lengths(2000, seed=8) // 32 + 3)
    base = ["plan", "--lengths", str(lengths), "--buckets", "3", "--token-budget", "1024"]
    base += ["--max-batch", "16"]
    assert main([*base, "--objective", "time"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --calibration: ") and err.count("\n") == 1
    assert main([*base, "--calibration", "x.json"]) == 2
    assert "only used with --objective time" in capsys.readouterr().err
    assert main([*base, "--objective", "time", "--calibration", str(tmp_path / "no.json")]) == 2
    assert "error: --calibration: " in capsys.readouterr().err
    cal = model(**TRUE).save(tmp_path / "cal.json")
    assert main([*base, "--objective", "time", "--calibration", str(cal)]) == 0
    out = capsys.readouterr().out
    assert f"objective: predicted time under {cal}" in out
    assert "tokens/s" in out and "padding objective's plan" in out
    assert main([*base, "--objective", "time", "--calibration", str(cal), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["objective"] == "time"
    r = d["rates"]
    assert r["simulated_tokens_s"] > 0 and r["padding_plan_tokens_s"] > 0
    # the simulated epoch and the DP's segment model agree closely on this data
    assert abs(r["simulated_tokens_s"] / r["predicted_tokens_s"] - 1) < 0.05
