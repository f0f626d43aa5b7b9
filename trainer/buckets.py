"""Bucket planner: globally optimal length-bucket boundaries for the bucketed-shuffle sampler.

Given sample lengths, a token budget T and a max batch B, `plan_buckets` finds the K boundaries
minimizing the expected padded tokens *of the sampler's own rule* (greedy packing inside each
shuffled bucket; model in `trainer.bucketing.estimate`, within ~0.1 pp of the sampler), by a
segmentation DP over candidate edges (`trainer.bucketing.dp`), reports the efficiency-vs-K curve,
and checks itself by running the sampler for one epoch. numpy only; importable without torch.

CLI:
    python -m trainer.buckets plan --lengths PATH --buckets K --token-budget T --max-batch B
        [--min-share F] [--candidates N] [--objective padding|time --calibration FILE] [--json]
    python -m trainer.buckets plan --strategy packed --lengths PATH --token-budget T
        --max-batch B --objective time --calibration FILE [--json]
    python -m trainer.buckets compare --lengths PATH --token-budget T --max-batch B
        [--buckets K | --boundaries a,b,c] [--epochs 2] [--candidates N] [--json]

--candidates N (default 2048, less for lengths spanning many batch sizes x classes, whose segments
cost more): up to N - 1 distinct lengths every one is a candidate cut and the plan is the exact
optimum; with more, a grid refined around the cuts (the output says so).

--objective time (with --calibration FILE, written by `python -m trainer.measure`) scores each
bucket by the predicted time of its batches under the fitted step-cost model
(`trainer.bucketing.timecost`) instead of its padded tokens, and reports predicted samples/s and
tokens/s (also for the padding-optimal plan, for comparison). With --strategy packed it
chooses the packed rows' length instead: each candidate's epoch as the sampler batches it,
priced by the model (`trainer.bucketing.row_length`), the fastest starred.

PATH is a `.npy` array of lengths or a token-store directory. Bad input exits 2 with one line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer.bucketing.compare import POOL_SIZE, POOLS_AT_LEAST
from trainer.bucketing.dp import (
    DEFAULT_CANDIDATES,
    GRID_CANDIDATES,
    Grid,
    default_candidates,
    make_grid,
    optimal_segmentations,
    segment_costs,
    segment_stats,
)
from trainer.bucketing.estimate import BucketEstimate, estimate_bucket, histogram
from trainer.bucketing.timecost import (
    CalibrationError,
    StepCostModel,
    epoch_features,
    segment_times,
)
from trainer.data.lengths import LengthsError, as_lengths, load_lengths
from trainer.sampler import BatchSampler, SamplerError

if TYPE_CHECKING:
    from trainer.config import BatchingConfig

DEFAULT_K_MAX = 16
REFINE_PASSES = 4  # grid search: re-solve around the cuts until they stop moving (1-2 in practice)


class PlanError(ValueError):
    """Unusable planner input; one line naming the argument (`flag` is its CLI spelling)."""

    def __init__(self, message: str, flag: str | None = None) -> None:
        super().__init__(message)
        self.flag = flag


@dataclass(frozen=True)
class BucketInfo:
    """One bucket [lo, hi) of a plan with its predicted packing."""

    lo: int
    hi: int
    count: int
    tokens: int
    mean: float
    max: int
    share: float
    mean_batch_size: float
    predicted_batches: float
    predicted_efficiency: float


@dataclass(frozen=True)
class SearchInfo:
    """Which cuts the DP could choose: every distinct length (exact) or a refined grid."""

    exact: bool  # every distinct length was a candidate: the plan is the exact optimum
    distinct_lengths: int
    candidates: int  # candidate edges of the final DP (including the two outer edges)
    max_candidates: int  # the budget: exact when distinct_lengths + 1 <= it
    grid_step: int | None  # grid only: spacing of the coarse candidate edges, in tokens
    refine_window: int | None  # grid only: every distinct length within this of a cut was tried
    grid_efficiency: float | None  # grid only: the coarse grid's optimum before refinement

    def describe(self) -> str:
        """One line for the table: what was searched and, for a grid, what it cannot promise."""
        if self.exact:
            return (
                f"search: exact, every one of the {self.distinct_lengths:,} distinct lengths "
                f"was a candidate cut ({self.candidates:,} edges)"
            )
        return (
            f"search: GRID, not proven optimal: {self.candidates:,} candidate edges of "
            f"{self.distinct_lengths:,} distinct lengths (every {self.grid_step} tokens, refined "
            f"to every length within {self.refine_window} of each cut); exact search: "
            f"--candidates {self.distinct_lengths + 1}"
        )


@dataclass
class TimeRates:
    """Predicted throughput of a plan under a step-cost model (`--calibration`)."""

    calibration: str  # the file (or "<model>")
    predicted_epoch_s: float  # the DP's own segment model (expected batches)
    predicted_samples_s: float
    predicted_tokens_s: float
    simulated_samples_s: float | None = None  # the model on the sampler's real epoch batches
    simulated_tokens_s: float | None = None
    padding_plan_boundaries: list[int] | None = None  # the padding objective's plan, same K
    padding_plan_tokens_s: float | None = None  # ... its simulated tokens/s under the model


@dataclass
class BucketPlan:
    """Boundaries (K+1 edges, bucket k = [edge k, edge k+1)) and what they are predicted to do."""

    boundaries: list[int]
    padding_efficiency: float
    buckets: list[BucketInfo]
    efficiency_by_k: dict[int, float]
    token_budget: int
    max_batch: int
    min_share: float
    num_samples: int
    total_tokens: int
    predicted_steps: float
    predicted_budget_use: float
    search: SearchInfo
    simulated_efficiency: float | None = None
    simulated_steps: int | None = None
    simulated_budget_use: float | None = None
    simulated_largest_batch: int | None = None
    timings: dict[str, float] = field(default_factory=dict)
    objective: str = "padding"  # or "time": predicted step time under a calibration
    rates: TimeRates | None = None  # with a calibration: predicted and simulated rates

    @property
    def k(self) -> int:
        return len(self.boundaries) - 1

    @property
    def co_batch_probability(self) -> float:
        """rho = sum of squared bucket shares: chance two random samples can share a batch."""
        return float(sum(b.share**2 for b in self.buckets))

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["k"] = self.k
        d["co_batch_probability"] = self.co_batch_probability
        d["efficiency_by_k"] = {str(k): v for k, v in self.efficiency_by_k.items()}
        d["search"]["description"] = self.search.describe()
        return d


def evaluate_boundaries(
    lengths: np.ndarray, boundaries: Sequence[int], token_budget: int, max_batch: int
) -> list[BucketEstimate]:
    """Full-resolution prediction for every bucket of the given K+1 edges."""
    x = np.asarray(lengths, dtype=np.int64)
    out = []
    for lo, hi in itertools.pairwise(boundaries):
        inside = x[(x >= lo) & (x < hi)]
        if inside.size == 0:
            out.append(BucketEstimate(0, 0, 0.0, 0.0, 0))
            continue
        values, counts = histogram(inside)
        out.append(estimate_bucket(values, counts, token_budget, max_batch))
    return out


def sampler_for(
    batching: BatchingConfig,
    lengths: np.ndarray,
    *,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    exclude: np.ndarray | None = None,
    max_length: int | None = None,
) -> BatchSampler:
    """The sampler a run config's `[batching]` describes, planning `boundaries = "plan"` first.

    One builder for the trainer and for every tool that must see the trainer's exact batches
    (the memory estimate). `max_length`: the store's (its manifest's), the packed rows' length
    when `batching.row_length` is unset (capped at token_budget; None: the longest sample).
    Raises PlanError or SamplerError (one line).
    """
    row_length = batching.row_length
    if row_length is None and max_length is not None and batching.strategy == "packed":
        row_length = min(max_length, batching.token_budget)
    bounds = batching.boundaries
    if bounds == "plan" and batching.strategy == "bucketed":
        bounds = plan_buckets(
            lengths, batching.num_buckets, batching.token_budget, batching.max_batch, simulate=False
        ).boundaries
    return BatchSampler(
        lengths,
        strategy=batching.strategy,
        boundaries=None if bounds == "plan" else list(bounds),
        token_budget=batching.token_budget,
        max_batch=batching.max_batch,
        seed=seed,
        rank=rank,
        world_size=world_size,
        pool_size=batching.pool_size,
        row_length=row_length,
        exclude=exclude,
    )


def _check_inputs(lengths: np.ndarray, token_budget: int, max_batch: int) -> np.ndarray:
    try:
        x = as_lengths(lengths)
    except LengthsError as exc:
        raise PlanError(str(exc)) from None
    if token_budget < 1 or max_batch < 1:
        raise PlanError(f"token budget ({token_budget}) and max batch ({max_batch}) must be >= 1")
    longest = int(np.argmax(x))
    if x[longest] > token_budget:
        raise PlanError(
            f"token budget {token_budget} is smaller than the longest sample "
            f"({int(x[longest])} tokens, sample {longest})",
            "--token-budget",
        )
    return x


def plan_buckets(
    lengths: np.ndarray | Sequence[int],
    k: int,
    token_budget: int,
    max_batch: int,
    min_share: float = 0.0,
    *,
    k_max: int | None = None,
    simulate: bool = True,
    seed: int = 0,
    max_candidates: int | None = None,
    cost_model: StepCostModel | None = None,
    calibration_name: str = "<model>",
) -> BucketPlan:
    """Optimal K-bucket boundaries for greedy token-budget packing, with the efficiency-vs-K curve.

    With at most `max_candidates - 1` distinct lengths every distinct length is a candidate cut
    and the plan is the exact optimum of the model. Beyond that the DP runs on a power-of-two grid
    of at most min(max_candidates, 512) edges, then again with every distinct length within one
    grid step of each chosen cut added, until the cuts stop moving (at most REFINE_PASSES times);
    `plan.search` says which happened.

    Args:
        lengths: tokens per sample.
        k: number of buckets.
        token_budget, max_batch: the sampler's T (padded tokens per batch) and B (samples).
        min_share: each bucket must hold at least this share of samples (diversity; 0 = none).
        k_max: largest K of `efficiency_by_k` (default max(k, 16)).
        simulate: also run the sampler for one epoch and report the measured efficiency.
        seed: the simulation's sampler seed.
        max_candidates: candidate-edge budget of the DP (exact when the distinct lengths fit).
            None: `default_candidates` (2,048, fewer for lengths spanning many batch-size
            classes, whose segments cost more).
        cost_model: the time objective: minimise the predicted epoch time under this step-cost
            model (`trainer.bucketing.timecost`) instead of the padded tokens; the plan's
            `rates` then hold predicted samples/s and tokens/s.

    Raises:
        PlanError: bad lengths, budget below the longest sample, K, min_share or the candidate
            budget out of range.
    """
    x = _check_inputs(np.asarray(lengths), token_budget, max_batch)
    if k < 1:
        raise PlanError(f"number of buckets must be >= 1, got {k}", "--buckets")
    if not 0.0 <= min_share < 1.0:
        raise PlanError(f"min share must be in [0, 1), got {min_share}", "--min-share")
    grid_candidates = GRID_CANDIDATES
    if max_candidates is None:  # both budgets shrink together for costly (many-class) lengths
        max_candidates = default_candidates(x, token_budget, max_batch)
        grid_candidates = max(64, GRID_CANDIDATES * max_candidates // DEFAULT_CANDIDATES)
    if max_candidates < 2:
        raise PlanError(f"must be >= 2 (edges), got {max_candidates}", "--candidates")
    n = len(x)
    t0 = time.perf_counter()
    min_count = max(1, int(np.ceil(min_share * n - 1e-9)))
    k_top = max(k, k_max or DEFAULT_K_MAX)
    grid = make_grid(x, max_candidates=max_candidates, grid_candidates=grid_candidates)
    solutions, padded_of = _solve(grid, token_budget, max_batch, min_count, k_top, cost_model)
    if k not in solutions:
        most = max(solutions) if solutions else 0
        extra = f" with at least {min_count} samples each (min share {min_share})" * (min_share > 0)
        if not grid.exact:
            extra += f" on a grid of {len(grid.edges)} candidate edges (raise --candidates)"
        raise PlanError(
            f"{k} buckets do not fit these lengths: at most {most} non-empty buckets{extra}",
            "--buckets",
        )
    total = int(x.sum())
    coarse = grid
    grid_eff = total / padded_of(solutions[k][1])
    if not grid.exact:
        near = np.zeros(0, dtype=np.int64)  # windows only grow, so each pass is no worse
        for _ in range(REFINE_PASSES):
            cuts = grid.edges[solutions[k][1]][1:-1]
            near = np.unique(np.concatenate([near, *(_near(coarse, int(c)) for c in cuts)]))
            refined = make_grid(
                x, max_candidates, extra_edges=near, grid_candidates=grid_candidates
            )
            if np.array_equal(refined.edges, grid.edges):
                break  # every cut's window was already searched
            grid = refined
            solutions, padded_of = _solve(
                grid, token_budget, max_batch, min_count, k_top, cost_model
            )
    search = SearchInfo(
        exact=grid.exact,
        distinct_lengths=grid.num_distinct,
        candidates=len(grid.edges),
        max_candidates=max_candidates,
        grid_step=None if grid.exact else coarse.step,
        refine_window=None if grid.exact else coarse.step,
        grid_efficiency=None if grid.exact else grid_eff,
    )
    by_k = {kk: total / padded_of(path) for kk, (_, path) in sorted(solutions.items())}
    edges = [int(e) for e in grid.edges[solutions[k][1]]]
    t1 = time.perf_counter()
    ests = evaluate_boundaries(x, edges, token_budget, max_batch)
    padded = sum(e.padded for e in ests)
    steps = sum(e.batches for e in ests)
    buckets = [
        BucketInfo(
            lo=lo,
            hi=hi,
            count=e.count,
            tokens=e.tokens,
            mean=e.tokens / e.count,
            max=e.max_len,
            share=e.count / n,
            mean_batch_size=e.mean_batch_size,
            predicted_batches=e.batches,
            predicted_efficiency=e.efficiency,
        )
        for lo, hi, e in zip(edges[:-1], edges[1:], ests, strict=True)
    ]
    # The curve's entry for K is the headline itself (the DP's value for these edges equals the
    # full re-score up to float rounding; one number is printed, not two).
    by_k[k] = total / padded
    plan = BucketPlan(
        boundaries=edges,
        padding_efficiency=total / padded,
        buckets=buckets,
        efficiency_by_k=by_k,
        token_budget=token_budget,
        max_batch=max_batch,
        min_share=min_share,
        num_samples=n,
        total_tokens=total,
        predicted_steps=steps,
        predicted_budget_use=total / (steps * token_budget),
        search=search,
    )
    t3 = time.perf_counter()
    plan.timings = {"search_s": t1 - t0, "rescore_s": t3 - t1}
    if simulate:
        simulate_plan(plan, x, seed=seed)
        plan.timings["simulate_s"] = time.perf_counter() - t3
    if cost_model is not None:
        plan.objective = "time"
        plan.rates = _time_rates(plan, x, ests, cost_model, calibration_name, seed, simulate)
    return plan


def _time_rates(
    plan: BucketPlan,
    x: np.ndarray,
    ests: list[BucketEstimate],
    model: StepCostModel,
    name: str,
    seed: int,
    simulate: bool,
) -> TimeRates:
    """The plan's predicted rates: from the DP's segment model, and (with `simulate`) from the
    sampler's real epoch batches, for this plan and for the padding objective's plan."""
    n = np.array([e.count for e in ests], dtype=np.float64)
    padded = np.array([e.padded for e in ests])
    batches = np.array([e.batches for e in ests])
    epoch_s = float(segment_times(model, padded, n, batches).sum())
    if not epoch_s > 0:
        raise PlanError(
            f"{name}: every coefficient is 0 (no step time to minimise)", "--calibration"
        )
    rates = TimeRates(name, epoch_s, plan.num_samples / epoch_s, plan.total_tokens / epoch_s)
    if simulate:
        rates.simulated_samples_s, rates.simulated_tokens_s = simulated_rates(
            x, plan.boundaries, plan.token_budget, plan.max_batch, model, seed
        )
        pad = plan_buckets(
            x,
            plan.k,
            plan.token_budget,
            plan.max_batch,
            plan.min_share,
            k_max=plan.k,
            simulate=False,
            max_candidates=plan.search.max_candidates,
        )
        rates.padding_plan_boundaries = pad.boundaries
        rates.padding_plan_tokens_s = simulated_rates(
            x, pad.boundaries, plan.token_budget, plan.max_batch, model, seed
        )[1]
    return rates


def simulated_rates(
    lengths: np.ndarray,
    boundaries: Sequence[int],
    token_budget: int,
    max_batch: int,
    model: StepCostModel,
    seed: int = 0,
) -> tuple[float, float]:
    """(samples/s, tokens/s) the model predicts for one epoch of the bucketed sampler."""
    sampler = BatchSampler(
        lengths,
        boundaries=list(boundaries),
        token_budget=token_budget,
        max_batch=max_batch,
        seed=seed,
    )
    batches = sampler.epoch_batches(0)
    seconds = float(model.predict(epoch_features(batches, model.anchor_blocks_per_sample)))
    samples = sum(len(b.indices) for b in batches)
    tokens = sum(b.real_tokens for b in batches)
    return samples / seconds, tokens / seconds


def _solve(
    grid: Grid,
    token_budget: int,
    max_batch: int,
    min_count: int,
    k_max: int,
    model: StepCostModel | None = None,
) -> tuple[dict[int, tuple[float, list[int]]], Callable[[list[int]], float]]:
    """The DP's optimum for every K (expected padded tokens, or with `model` predicted seconds),
    and a function giving any solution's expected padded tokens."""
    if model is None:
        cost, _ = segment_costs(grid, token_budget, max_batch, min_count)
        objective = cost
    else:
        cost, counts, batches = segment_stats(grid, token_budget, max_batch, min_count)
        objective = segment_times(model, cost, counts.astype(np.float64), batches)

    def padded_of(path: list[int]) -> float:
        return float(sum(cost[a, b] for a, b in itertools.pairwise(path)))

    return optimal_segmentations(objective, k_max), padded_of


def _near(grid: Grid, cut: int) -> np.ndarray:
    """Every distinct length within one grid step of `cut` (its refinement window)."""
    d = grid.rep.astype(np.int64)
    return d[(d > cut - grid.step) & (d < cut + grid.step)]


def simulate_plan(plan: BucketPlan, lengths: np.ndarray, seed: int = 0) -> None:
    """Run the sampler for one epoch on the plan's boundaries and record what it measured."""
    sampler = BatchSampler(
        lengths,
        boundaries=plan.boundaries,
        token_budget=plan.token_budget,
        max_batch=plan.max_batch,
        seed=seed,
    )
    batches = sampler.epoch_batches(0)
    padded = np.fromiter((b.padded_tokens for b in batches), np.int64, len(batches))
    plan.simulated_efficiency = plan.total_tokens / int(padded.sum())
    plan.simulated_steps = len(batches)
    plan.simulated_budget_use = plan.total_tokens / (len(batches) * plan.token_budget)
    plan.simulated_largest_batch = int(padded.max())


def _pct(v: float | None) -> str:
    return "   -  " if v is None else f"{100 * v:5.1f}%"


def _search_lines(search: dict[str, Any] | None) -> list[str]:
    """The search description split at its clauses (a plan from before it existed: none)."""
    return search["description"].replace("; ", ";\n  ").split("\n") if search else []


def format_plan_table(plan: dict[str, Any]) -> str:
    """Readable table of a plan's JSON dict (what `plan` prints without --json; dflashctl too)."""
    lines = [
        f"Bucket plan: K={plan['k']}  T={plan['token_budget']:,}  B={plan['max_batch']}  "
        f"samples={plan['num_samples']:,}  tokens={plan['total_tokens']:,}"
        + (f"  min share={plan['min_share']:.1%}" if plan.get("min_share") else ""),
        f"boundaries: {plan['boundaries']}",
        *_search_lines(plan.get("search")),
        f"padding efficiency: predicted {_pct(plan['padding_efficiency'])}, "
        f"simulated {_pct(plan.get('simulated_efficiency'))}   "
        f"steps/epoch ~{plan['predicted_steps']:,.0f}   "
        f"budget use {_pct(plan['predicted_budget_use'])}",
        "",
        f"{'bucket':>15} {'count':>9} {'share':>6} {'tokens':>14} {'mean':>7} {'max':>6} "
        f"{'batch':>6} {'eff':>6}",
    ]
    for b in plan["buckets"]:
        lines.append(
            f"{'[' + str(b['lo']) + ', ' + str(b['hi']) + ')':>15} {b['count']:>9,} "
            f"{_pct(b['share'])} {b['tokens']:>14,} {b['mean']:>7.0f} {b['max']:>6} "
            f"{b['mean_batch_size']:>6.1f} {_pct(b['predicted_efficiency'])}"
        )
    curve = "  ".join(f"{k}:{100 * v:.1f}" for k, v in plan["efficiency_by_k"].items())
    lines += ["", f"efficiency by K (%): {curve}"]
    lines += _rate_lines(plan.get("rates"))
    gap = (plan.get("search") or {}).get("grid_efficiency")
    if gap is not None:
        lines.append(
            f"grid alone: {_pct(gap)}; refining around the cuts gained "
            f"{100 * (plan['padding_efficiency'] - gap):+.3f} pp"
        )
    return "\n".join(lines)


def _rate_lines(rates: dict[str, Any] | None) -> list[str]:
    """The time objective's lines (a padding plan: none)."""
    if not rates:
        return []
    out = [
        f"objective: predicted time under {rates['calibration']}",
        f"predicted: {rates['predicted_samples_s']:,.1f} samples/s, "
        f"{rates['predicted_tokens_s']:,.0f} tokens/s (epoch {rates['predicted_epoch_s']:,.1f} s)",
    ]
    if rates.get("simulated_tokens_s") is not None:
        out.append(
            f"on the simulated epoch: {rates['simulated_samples_s']:,.1f} samples/s, "
            f"{rates['simulated_tokens_s']:,.0f} tokens/s"
        )
    if rates.get("padding_plan_tokens_s") is not None:
        gain = rates["simulated_tokens_s"] / rates["padding_plan_tokens_s"] - 1
        out.append(
            f"padding objective's plan {rates['padding_plan_boundaries']}: "
            f"{rates['padding_plan_tokens_s']:,.0f} tokens/s ({100 * gain:+.1f}% for this plan)"
        )
    return out


COMPARE_LEGEND = (
    "pad eff = real / padded tokens; budget = real tokens / (steps x T)",
    "max padded = largest batch in padded tokens (size x longest sample, never above T)",
    "row fill = packed only: real tokens / (rows x row_length); its pad eff pads to the fullest row",
    "pairs/ep = sample pairs sharing a batch in one epoch",
    "repeat = share of one epoch's pairs that share a batch again in the next",
    "  (low = fresh batch composition every epoch; needs --epochs >= 2)",
)


def format_compare_table(result: dict[str, Any]) -> str:
    """Readable side-by-side table of `compare` output, with its legend and any warnings."""
    lines = [
        f"T={result['token_budget']:,}  B={result['max_batch']}  samples={result['num_samples']:,}"
        f"  epochs={result['epochs']}  bucket boundaries={result['boundaries']}",
        f"{'strategy':<10} {'pad eff':>8} {'row fill':>8} {'budget':>8} {'steps/ep':>9} "
        f"{'max padded':>10} {'pairs/ep':>11} {'repeat':>8}",
    ]
    for r in result["strategies"]:
        rep = "-" if r["pair_repeat"] is None else f"{100 * r['pair_repeat']:.3f}%"
        name = r["strategy"] + ("*" if r.get("same_as_sorted") else "")
        fill = r.get("row_fill")
        lines.append(
            f"{name:<10} {_pct(r['padding_efficiency']):>8} "
            f"{'-' if fill is None else _pct(fill):>8} {_pct(r['budget_use']):>8} "
            f"{r['steps_per_epoch']:>9,.0f} {r['largest_padded_batch']:>10,} "
            f"{r['pairs_per_epoch']:>11,} {rep:>8}"
        )
    lines += COMPARE_LEGEND
    if result.get("pool_size") is not None and any(
        r["strategy"] == "pool-sort" for r in result["strategies"]
    ):
        how = (
            f" (default: {POOL_SIZE:,}, at most 1/{POOLS_AT_LEAST} of the "
            f"{result['num_samples']:,} samples)"
            if result.get("pool_size_default")
            else ""
        )
        lines.append(f"pool-sort pool = {result['pool_size']:,} samples{how}")
    if any(r.get("same_as_sorted") for r in result["strategies"]):
        lines.append("* = the pool holds every sample: this IS the sorted strategy (warning below)")
    lines += [f"bucket boundaries: {result['search']}"] if result.get("search") else []
    if result.get("predicted_efficiency") is not None:
        lines.append(f"bucketed predicted by the planner: {_pct(result['predicted_efficiency'])}")
    lines += [f"warning: {w}" for w in result.get("warnings", [])]
    return "\n".join(lines)


# ----- CLI ----------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.buckets", description=__doc__.split("\n")[0]
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--lengths", required=True, help=".npy of lengths or a token-store dir")
    common.add_argument("--token-budget", type=int, required=True, help="padded tokens per batch")
    common.add_argument("--max-batch", type=int, required=True, help="samples per batch")
    common.add_argument("--json", action="store_true", help="print one JSON object")
    common.add_argument(
        "--candidates",
        type=int,
        default=None,
        help=f"candidate cut budget of the DP (default {DEFAULT_CANDIDATES}, less for lengths "
        "spanning many batch sizes x classes): every distinct length when they fit (exact "
        "optimum), else a refined grid (said in the output)",
    )
    plan = sub.add_parser("plan", parents=[common], help="optimal boundaries for K buckets")
    plan.add_argument(
        "--strategy",
        choices=("bucketed", "packed"),
        default="bucketed",
        help="bucketed: boundaries for K buckets; packed: the row length (--objective time)",
    )
    plan.add_argument("--buckets", type=int, help="number of buckets K (bucketed)")
    plan.add_argument("--min-share", type=float, default=0.0, help="min share of samples/bucket")
    plan.add_argument("--seed", type=int, default=0, help="seed of the simulated epoch")
    plan.add_argument(
        "--objective",
        choices=("padding", "time"),
        default="padding",
        help="minimise expected padded tokens, or predicted epoch time (needs --calibration)",
    )
    plan.add_argument(
        "--calibration", help="step-cost calibration (JSON) from python -m trainer.measure"
    )
    cmp_ = sub.add_parser("compare", parents=[common], help="strategies side by side")
    which = cmp_.add_mutually_exclusive_group()
    which.add_argument("--buckets", type=int, help="plan K buckets with the DP (default 6)")
    which.add_argument("--boundaries", help="comma-separated bucket cuts, e.g. 770,1216,1728")
    cmp_.add_argument("--epochs", type=int, default=2, help="epochs to run (>= 2 for diversity)")
    cmp_.add_argument(
        "--pool-size",
        type=int,
        default=None,
        help=f"pool size for pool-sort (default: {POOL_SIZE:,}, at most 1/{POOLS_AT_LEAST} of "
        "the samples)",
    )
    cmp_.add_argument(
        "--row-length", type=int, default=None, help="row length for packed (default: longest)"
    )
    cmp_.add_argument("--seed", type=int, default=0)
    return ap


def parse_boundaries(text: str, lengths: np.ndarray) -> list[int]:
    """Cuts 'a,b,c' -> K+1 edges [min, a, b, c, max + 1]; outer edges given by the user are kept."""
    try:
        cuts = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise PlanError(f"{text!r}: expected comma-separated integers", "--boundaries") from None
    if not cuts or any(b >= c for b, c in itertools.pairwise(cuts)):
        raise PlanError(f"{text!r}: expected strictly increasing integers", "--boundaries")
    lo, hi = int(lengths.min()), int(lengths.max()) + 1
    inner = [c for c in cuts if lo < c < hi]
    first = min(cuts[0], lo)
    last = cuts[-1] if cuts[-1] >= hi else hi
    return [first, *inner, last]


def _run_plan(args: argparse.Namespace, x: np.ndarray) -> int:
    model = None
    if args.objective == "time":
        if not args.calibration:
            raise PlanError(
                "the time objective needs a step-cost calibration: run python -m trainer.measure",
                "--calibration",
            )
        try:
            model = StepCostModel.load(args.calibration)
        except CalibrationError as exc:
            raise PlanError(str(exc), "--calibration") from None
    elif args.calibration:
        raise PlanError("only used with --objective time", "--calibration")
    if args.strategy == "packed":
        if args.buckets is not None:
            raise PlanError("packed rows have no buckets: leave it out", "--buckets")
        if model is None:
            raise PlanError(
                "packed has no boundaries; its row length is chosen by predicted time: "
                "add --objective time --calibration FILE",
                "--strategy",
            )
        return _run_plan_packed(args, x, model)
    if args.buckets is None:
        raise PlanError("the number of buckets K is required for --strategy bucketed", "--buckets")
    plan = plan_buckets(
        x,
        args.buckets,
        args.token_budget,
        args.max_batch,
        args.min_share,
        seed=args.seed,
        max_candidates=args.candidates,
        cost_model=model,
        calibration_name=str(args.calibration),
    )
    d = plan.to_json_dict()
    print(json.dumps(d, indent=1) if args.json else format_plan_table(d))
    return 0


def _run_plan_packed(args: argparse.Namespace, x: np.ndarray, model: StepCostModel) -> int:
    """`plan --strategy packed --objective time`: every candidate row length, the fastest."""
    from trainer.bucketing.row_length import best_row_length, row_length_options

    x = _check_inputs(x, args.token_budget, args.max_batch)
    options = row_length_options(
        x, token_budget=args.token_budget, max_batch=args.max_batch, model=model, seed=args.seed
    )
    best = best_row_length(options)
    result = {
        "strategy": "packed",
        "objective": "time",
        "calibration": str(args.calibration),
        "document_attention": bool(model.meta.get("document_attention", False)),
        "token_budget": args.token_budget,
        "max_batch": args.max_batch,
        "num_samples": len(x),
        "row_length": best.row_length,
        "options": [o.to_json_dict() for o in options],
    }
    print(json.dumps(result, indent=1) if args.json else format_row_length_table(result))
    return 0


def format_row_length_table(result: dict[str, Any]) -> str:
    """The packed row-length choice: one line per candidate, the chosen one starred."""
    attention = "per document" if result["document_attention"] else "over whole rows (row length^2)"
    lines = [
        f"packed rows under {result['calibration']}: {result['num_samples']:,} samples, "
        f"T={result['token_budget']}, B={result['max_batch']}, target attention {attention}",
        f"{'row length':>11} {'batches':>8} {'row fill':>8} {'pad eff':>8} "
        f"{'pred. s/epoch':>13} {'samples/s':>10} {'tokens/s':>10}",
    ]
    for o in result["options"]:
        star = "*" if o["row_length"] == result["row_length"] else " "
        lines.append(
            f"{star}{o['row_length']:>10} {o['batches']:>8,} {_pct(o['row_fill']):>8} "
            f"{_pct(o['padding_efficiency']):>8} {o['predicted_s']:>13.2f} "
            f"{o['samples_s']:>10,.1f} {o['tokens_s']:>10,.0f}"
        )
    lines.append(
        f'* = the fastest predicted epoch: [batching] strategy = "packed", '
        f"row_length = {result['row_length']}"
    )
    return "\n".join(lines)


def _run_compare(args: argparse.Namespace, x: np.ndarray) -> int:
    from trainer.bucketing.compare import compare_strategies, default_pool_size

    if args.epochs < 1:
        raise PlanError(f"must be >= 1, got {args.epochs}", "--epochs")
    _check_inputs(x, args.token_budget, args.max_batch)
    search = None
    if args.boundaries:
        edges = parse_boundaries(args.boundaries, x)
    else:
        plan = plan_buckets(
            x,
            args.buckets or 6,
            args.token_budget,
            args.max_batch,
            simulate=False,
            max_candidates=args.candidates,
        )
        edges, search = plan.boundaries, plan.search.describe()
    predicted = evaluate_boundaries(x, edges, args.token_budget, args.max_batch)
    pool = args.pool_size if args.pool_size is not None else default_pool_size(len(x))
    reports = compare_strategies(
        x,
        edges,
        args.token_budget,
        args.max_batch,
        epochs=args.epochs,
        seed=args.seed,
        pool_size=pool,
        row_length=args.row_length,
    )
    result = {
        "token_budget": args.token_budget,
        "max_batch": args.max_batch,
        "num_samples": len(x),
        "epochs": args.epochs,
        "boundaries": edges,
        "search": search,
        "predicted_efficiency": int(x.sum()) / sum(e.padded for e in predicted),
        "pool_size": pool,
        "pool_size_default": args.pool_size is None,
        "strategies": [r.to_json_dict() for r in reports],
        "warnings": [w for r in reports for w in r.warnings],
    }
    print(json.dumps(result, indent=1) if args.json else format_compare_table(result))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (2 on bad input, with one line on stderr)."""
    args = _parser().parse_args(argv)
    try:
        try:
            x = load_lengths(args.lengths)
        except LengthsError as exc:
            raise PlanError(str(exc), "--lengths") from None
        return _run_plan(args, x) if args.cmd == "plan" else _run_compare(args, x)
    except (PlanError, SamplerError) as exc:
        flag = getattr(exc, "flag", None)
        print(f"error: {flag + ': ' if flag else ''}{exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:  # `... | head`: the reader left; no traceback, no flush error at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
