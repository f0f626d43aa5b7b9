"""Rates, ratios to sorted, the step-cost fit and predictions from the timed runs; the table.

Rates of one run are totals over its timed steps divided by their wall time (the end of the last
timed step minus the end of the warm-up). A strategy's rate is the median over rounds; its ratio
to sorted is taken round by round (same machine state) and reported as median and range.

The step-cost model (`trainer.bucketing.timecost`) is fitted on windows of `window` consecutive
timed steps (a pipeline overlaps each step with the next batches' target work, so single-step
times mix neighbours; window sums do not, up to the edges). Each strategy's predicted rate
applies the fit to the features of epoch 0's batches (not to the timed steps: the prediction
sees only what the planner could), and `predicted_loo_*` does the same with a fit that never saw
that strategy's timings (leave-one-strategy-out: the honest check).

The clock (`--clock`) is wall time by default. `cpu` uses the trainer process's CPU seconds
(all threads) instead: on a machine shared with other work, wall time swings with their load
(3x within minutes on the 2-core development machine) while the CPU time of the work done does
not; on a quiet machine it is wall time x the cores the pipeline keeps busy. Every rate is then
per CPU-second; the wall rates and ratios are reported beside them (`wall_*`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from trainer.bucketing.timecost import FEATURES, StepCostModel, fit_step_cost
from trainer.measure.drive import StrategyInfo, StrategyRun, variant

RATES = ("samples_s", "tokens_s", "anchor_blocks_s", "padded_tokens_s")


@dataclass(frozen=True)
class RunRates:
    seconds: float
    samples_s: float
    tokens_s: float
    anchor_blocks_s: float
    padded_tokens_s: float

    def get(self, name: str) -> float:
        value: float = getattr(self, name)
        return value


CLOCKS = ("wall", "cpu")


def _ends(run: StrategyRun, clock: str) -> np.ndarray:
    return run.cpu_ends if clock == "cpu" else run.ends


def run_rates(run: StrategyRun, clock: str = "wall") -> RunRates:
    sec = float(_ends(run, clock)[-1])
    return RunRates(
        seconds=sec,
        samples_s=float(run.samples.sum()) / sec,
        tokens_s=float(run.real_tokens.sum()) / sec,
        anchor_blocks_s=float(run.real_blocks.sum()) / sec,
        padded_tokens_s=float(run.features[:, 0].sum()) / sec,
    )


def windows(run: StrategyRun, window: int, clock: str = "wall") -> tuple[np.ndarray, np.ndarray]:
    """(summed features, seconds) of consecutive `window`-step windows of one run."""
    ends = _ends(run, clock)
    n = len(ends) // window
    starts = np.concatenate(([0.0], ends))
    feats = np.stack([run.features[k * window : (k + 1) * window].sum(0) for k in range(n)])
    secs = np.array([starts[(k + 1) * window] - starts[k * window] for k in range(n)])
    return feats.reshape(n, len(FEATURES)), secs


def default_window(steps: int) -> int:
    """8 steps per window when there are enough for 4 windows, fewer otherwise."""
    return max(1, min(8, steps // 4))


def fit(
    runs: Mapping[str, Sequence[StrategyRun]],
    window: int,
    exclude: str | None = None,
    clock: str = "wall",
) -> tuple[dict[str, float], float, int]:
    """Step-cost fit over every run's windows (but `exclude`'s): (coef, R^2, windows)."""
    parts = [windows(r, window, clock) for s, rs in runs.items() if s != exclude for r in rs]
    x = np.concatenate([f for f, _ in parts])
    y = np.concatenate([t for _, t in parts])
    coef, r2 = fit_step_cost(x, y)
    return coef, r2, len(y)


def anchor_blocks_per_sample(runs: Mapping[str, Sequence[StrategyRun]]) -> float:
    """Padded anchor blocks per sample over the padded strategies' timed steps (the planner's
    per-sample constant)."""
    rs = [r for s, rr in runs.items() if variant(s)[0] != "packed" for r in rr] or [
        r for rr in runs.values() for r in rr
    ]
    blocks = sum(float(r.features[:, 2].sum()) for r in rs)
    samples = sum(float(r.features[:, 3].sum()) for r in rs)
    return blocks / samples if samples else 0.0


def predicted(model: StepCostModel, info: StrategyInfo) -> tuple[float, float]:
    """(samples/s, tokens/s) the model predicts on the strategy's epoch batches."""
    sec = float(model.predict(info.epoch_features).sum())
    if sec <= 0:
        return float("nan"), float("nan")
    return float(info.epoch_samples.sum()) / sec, float(info.epoch_tokens.sum()) / sec


def pool_sort_flag(info: StrategyInfo) -> str | None:
    """A pool holding every sample is the sorted strategy: said in the table and the JSON."""
    if info.strategy == "pool-sort" and info.warnings:
        return "pool holds every sample: this is the sorted strategy (see warnings)"
    return None


def build_result(
    runs: Mapping[str, Sequence[StrategyRun]],
    infos: Mapping[str, StrategyInfo],
    *,
    window: int,
    meta: Mapping[str, object],
    prior: StepCostModel | None = None,
    clock: str = "wall",
) -> tuple[dict[str, object], StepCostModel]:
    """The JSON result (`strategies`, `calibration`, ...) and the fitted model."""
    coef, r2, points = fit(runs, window, clock=clock)
    model = StepCostModel(
        coef, r2, points, anchor_blocks_per_sample(runs), {**meta, "clock": clock}
    )
    rates = {s: [run_rates(r, clock) for r in rs] for s, rs in runs.items()}
    wall = {s: [run_rates(r) for r in rs] for s, rs in runs.items()}
    rounds = min(len(v) for v in rates.values())
    out: dict[str, dict[str, object]] = {}
    for s, rs in rates.items():
        info = infos[s]
        entry: dict[str, object] = {
            name: statistics.median(r.get(name) for r in rs) for name in RATES
        }
        tokens = sum(int(r.real_tokens.sum()) for r in runs[s])
        padded = sum(float(r.features[:, 0].sum()) for r in runs[s])
        entry["padding_efficiency"] = tokens / padded if padded else None
        entry["largest_batch"] = max(r.largest_batch for r in runs[s])
        entry["largest_batch_samples"] = max(r.largest_samples for r in runs[s])
        entry["repeat"] = info.repeat
        entry["steps_per_epoch"] = info.steps_per_epoch
        entry["rounds"] = [{name: r.get(name) for name in ("seconds", *RATES)} for r in rs]
        entry["ratio_to_sorted"] = _ratios(rates, s, rounds)
        if clock != "wall":
            entry["wall_tokens_s"] = statistics.median(r.tokens_s for r in wall[s])
            ratio = _ratios(wall, s, rounds)
            entry["wall_ratio_to_sorted"] = None if ratio is None else ratio["tokens_s"]
        ps, pt = predicted(model, info)
        entry["predicted_samples_s"], entry["predicted_tokens_s"] = ps, pt
        entry["prediction_error"] = pt / statistics.median(r.tokens_s for r in rs) - 1
        if len(runs) > 1:
            loo_coef, _, _ = fit(runs, window, exclude=s, clock=clock)
            loo = StepCostModel(loo_coef, 0.0, 0, model.anchor_blocks_per_sample)
            entry["predicted_loo_tokens_s"] = predicted(loo, info)[1]
        else:
            entry["predicted_loo_tokens_s"] = None
        if prior is not None:
            entry["predicted_prior_tokens_s"] = predicted(prior, info)[1]
        entry["flag"] = pool_sort_flag(info)
        entry["warnings"] = list(info.warnings)
        out[s] = entry
    result: dict[str, object] = {
        **meta,
        "clock": clock,
        "window": window,
        "strategies": out,
        "calibration": model.to_json_dict(),
        "warnings": sorted({w for i in infos.values() for w in i.warnings}),
    }
    return result, model


def _ratios(
    rates: Mapping[str, Sequence[RunRates]], s: str, rounds: int
) -> dict[str, dict[str, float]] | None:
    """Each rate of `s` over sorted's in the same round: median and range (None: no sorted)."""
    if "sorted" not in rates:
        return None
    return {
        name: _spread([rates[s][i].get(name) / rates["sorted"][i].get(name) for i in range(rounds)])
        for name in RATES
    }


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _k(v: float) -> str:
    return f"{v / 1e3:,.2f}k" if v >= 1e3 else f"{v:,.1f}"


def format_table(result: Mapping[str, object]) -> str:
    """The measure table (what `python -m trainer.measure` prints without --json)."""
    strategies = result["strategies"]
    assert isinstance(strategies, dict)
    clock = result.get("clock", "wall")
    w = max([10, *map(len, strategies)])  # packed@1024 is 11
    lines = [
        f"config {result.get('config')}  device {result.get('device')}  "
        f"{result.get('steps')} steps after {result.get('warmup')} warm-up, "
        f"{result.get('rounds')} round(s), strategies interleaved; clock: {clock}"
        + (" (rates per CPU-second of the trainer; wall figures at the end)" * (clock == "cpu")),
        f"{'strategy':<{w}} {'tok/s':>9} {'per round':>19} {'vs sorted':>17} {'samples/s':>9} "
        f"{'blocks/s':>9} {'padded/s':>9} {'pad eff':>7} {'largest':>7} {'repeat':>7} "
        f"{'predicted':>9} {'err':>6} {'loo err':>7}",
    ]
    for name, e in strategies.items():
        per_round = ", ".join(_k(r["tokens_s"]) for r in e["rounds"])
        ratio = e["ratio_to_sorted"]
        vs = "-"
        if ratio is not None:
            t = ratio["tokens_s"]
            vs = f"{t['median']:.2f} [{t['min']:.2f}-{t['max']:.2f}]"
        rep = "-" if e["repeat"] is None else f"{100 * e['repeat']:.2f}%"
        loo = e.get("predicted_loo_tokens_s")
        loo_err = "-" if loo is None else f"{100 * (loo / e['tokens_s'] - 1):+.1f}%"
        lines.append(
            f"{name:<{w}} {_k(e['tokens_s']):>9} {per_round:>19} {vs:>17} "
            f"{e['samples_s']:>9,.1f} {_k(e['anchor_blocks_s']):>9} {_k(e['padded_tokens_s']):>9} "
            f"{100 * e['padding_efficiency']:>6.1f}% {e['largest_batch']:>7,} {rep:>7} "
            f"{_k(e['predicted_tokens_s']):>9} {100 * e['prediction_error']:>+5.1f}% {loo_err:>7}"
        )
    cal = result["calibration"]
    assert isinstance(cal, dict)
    model = StepCostModel.from_json_dict(cal)
    lines += [
        "tok/s = real (unpadded) tokens per second; vs sorted = ratio in the same round, "
        "median [range]",
        "blocks/s = anchor blocks from real eligible positions; repeat = share of co-batched "
        "pairs batched together again next epoch",
        "predicted = the step-cost fit on epoch 0's batches; err = predicted / measured - 1; "
        "loo = the fit without that strategy's timings",
        model.describe(),
    ]
    for name, e in strategies.items():
        if e.get("wall_tokens_s") is not None:
            r = e.get("wall_ratio_to_sorted")
            vs = (
                "" if r is None else f", {r['median']:.2f} [{r['min']:.2f}-{r['max']:.2f}] x sorted"
            )
            lines.append(f"wall: {name} {_k(e['wall_tokens_s'])} tok/s{vs}")
    for name, e in strategies.items():
        if e.get("flag"):
            lines.append(f"flag: {name}: {e['flag']}")
        if e.get("predicted_prior_tokens_s") is not None:
            prior = e["predicted_prior_tokens_s"]
            lines.append(
                f"prior calibration: {name} predicted {_k(prior)} tok/s "
                f"({100 * (prior / e['tokens_s'] - 1):+.1f}%)"
            )
    warnings = result.get("warnings") or []
    assert isinstance(warnings, list)
    lines += [f"warning: {w}" for w in warnings]
    if result.get("calibration_file"):
        lines.append(f"calibration saved to {result['calibration_file']}")
    return "\n".join(lines)
