"""Bucket planner and sampler on the bundled seed-shaped lengths (902,087 samples, 1.866e9 tokens).

Prints, measured in one run on one core:
  1. planner runtime for K = 6 (issue bar: <= 10 s on one core), CPU and wall time;
  2. predicted vs simulated padding efficiency for K = 4, 6, 8, 12 and the seed's boundaries,
     next to the fixed-batch-size estimate (rule (c) of bucketing.md) the planner replaced;
  3. the `compare` table (sorted static, random, bucketed, pool-sort) for the seed's boundaries
     [770, 1216, 1728, 2432, 3296] and the DP's K = 6 boundaries, T = 49,152, B = 64, 2 epochs.

  4. the exact search (every distinct length a candidate cut) against the number of distinct
     lengths, on seed-shaped subsamples and a store-shaped 2,679-row sample (issue 10);
  5. the refined grid against the exact search where both run, and (--exact-seed, minutes and
     ~1 GB) on the full seed-shaped sample's 8,127 distinct lengths.

Run: .venv/bin/python benchmarks/bench_buckets.py [--search-only] [--exact-seed]
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import itertools
import math
import time
from pathlib import Path

import numpy as np

from trainer.bucketing.compare import measure
from trainer.bucketing.dp import DEFAULT_CANDIDATES
from trainer.buckets import BucketPlan, evaluate_boundaries, plan_buckets
from trainer.data.lengths import load_lengths
from trainer.sampler import BatchSampler

SAMPLE = Path(__file__).resolve().parents[1] / "trainer" / "data" / "samples" / "seed_lengths.npy"
T, B = 49_152, 64
SEED_CUTS = [770, 1216, 1728, 2432, 3296]


def fixed_b_estimate(x: np.ndarray, edges: list[int]) -> float:
    """Rule (c): b = max{b <= B : b E[M_b] <= T}, E[M_b] from order statistics (no replacement)."""
    padded = 0.0
    for lo, hi in itertools.pairwise(edges):
        v = np.sort(x[(x >= lo) & (x < hi)]).astype(np.float64)
        n = len(v)
        if n == 0:
            continue
        lf = np.array([math.lgamma(i + 1) for i in range(n + 1)])

        def e_max(b: int, v: np.ndarray = v, n: int = n, lf: np.ndarray = lf) -> float:
            j = np.arange(b, n + 1)  # rank j is the max: C(j-1, b-1) / C(n, b)
            logp = (lf[j - 1] - lf[b - 1] - lf[j - b]) - (lf[n] - lf[b] - lf[n - b])
            return float(np.dot(v[j - 1], np.exp(logp)))

        b = max([1] + [bb for bb in range(1, min(B, n) + 1) if bb * e_max(bb) <= T])
        full, r = divmod(n, b)
        padded += full * b * e_max(b) + (r * e_max(r) if r else 0.0)
    return float(x.sum()) / padded


def simulated(x: np.ndarray, edges: list[int], seeds: tuple[int, ...] = (0, 1)) -> float:
    real = padded = 0
    for seed in seeds:
        batches = BatchSampler(x, boundaries=edges, token_budget=T, max_batch=B, seed=seed)
        for b in batches.epoch_batches(0):
            real += b.real_tokens
            padded += b.padded_tokens
    return real / padded


def timed_plan(
    x: np.ndarray, k: int, candidates: int = DEFAULT_CANDIDATES
) -> tuple[float, BucketPlan]:
    cpu = time.process_time()
    plan = plan_buckets(x, k, T, B, simulate=False, max_candidates=candidates)
    return time.process_time() - cpu, plan


def store_like(n: int = 2_679, seed: int = 0) -> np.ndarray:
    """Shaped like the issue's real store: lognormal lengths clipped to 27..8192."""
    rng = np.random.default_rng(seed)
    return np.clip(np.round(rng.lognormal(np.log(1500), 0.9, n)), 27, 8192).astype(np.int64)


def search_sections(x: np.ndarray, exact_seed: bool) -> None:
    print("\n4. exact search, K=6 (every distinct length a candidate; CPU s, one core)")
    rng = np.random.default_rng(0)
    cases = [(f"seed sample, {n:,} rows", rng.choice(x, n)) for n in (600, 1_200, 2_000, 3_000)]
    cases.append(("store-shaped, 2,679 rows", store_like()))
    exact: dict[str, BucketPlan] = {}
    for name, xs in cases:
        d = len(np.unique(xs))
        cpu, plan = timed_plan(xs, 6, d + 1)
        exact[name] = plan
        print(
            f"   {name:<26} {d:>6,} distinct  {cpu:>6.2f} s  {100 * plan.padding_efficiency:.3f} %"
        )
    print("\n5. refined grid vs exact, K=6 (pp = grid - exact)")
    for name in ("seed sample, 3,000 rows", "store-shaped, 2,679 rows"):
        xs = dict(cases)[name]
        for cand in (129, 257, 513):
            cpu, plan = timed_plan(xs, 6, cand)
            gap = 100 * (plan.padding_efficiency - exact[name].padding_efficiency)
            coarse_eff = plan.search.grid_efficiency
            assert coarse_eff is not None  # a refined grid search reports its coarse optimum
            coarse = 100 * (coarse_eff - exact[name].padding_efficiency)
            print(
                f"   {name:<26} --candidates {cand:<4} step {plan.search.grid_step:>3}: "
                f"{plan.search.candidates:>4} edges {cpu:>5.2f} s  refined {gap:+.4f} pp"
                f"  grid alone {coarse:+.4f} pp"
            )
    if exact_seed:
        cpu, grid = timed_plan(x, 6)
        cpu_e, ex = timed_plan(x, 6, len(np.unique(x)) + 1)
        print(
            f"   full seed sample: grid {100 * grid.padding_efficiency:.4f} % ({cpu:.1f} s), exact "
            f"{100 * ex.padding_efficiency:.4f} % ({cpu_e:.1f} s): "
            f"{100 * (grid.padding_efficiency - ex.padding_efficiency):+.4f} pp; exact cuts "
            f"{ex.boundaries}"
        )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--search-only", action="store_true", help="sections 1, 4 and 5 only")
    ap.add_argument("--exact-seed", action="store_true", help="exact search on 8,127 lengths")
    args = ap.parse_args()
    x = load_lengths(SAMPLE)
    print(f"lengths: {len(x):,} samples, {int(x.sum()):,} tokens, T={T:,}, B={B}")

    cpu, wall = time.process_time(), time.perf_counter()
    plan = plan_buckets(x, 6, T, B, simulate=False)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    print(f"\n1. planner K=6: {cpu:.2f} s CPU, {wall:.2f} s wall (bar: <= 10 s on one core)")
    print(f"   boundaries {plan.boundaries}, {100 * plan.padding_efficiency:.4f} %")
    print(f"   {plan.search.describe()}")
    if args.search_only:
        search_sections(x, args.exact_seed)
        return

    print("\n2. predicted vs simulated padding efficiency (simulated: 2 epochs of the sampler)")
    print(
        f"   {'boundaries':<8} {'planner':>8} {'sampler':>8} {'gap pp':>7} {'fixed-b':>8} {'gap pp':>7}"
    )
    rows: list[tuple[str, list[int]]] = [
        (f"DP K={k}", plan_buckets(x, k, T, B, simulate=False).boundaries) for k in (4, 6, 8, 12)
    ]
    rows.append(("seed", [int(x.min()), *SEED_CUTS, int(x.max()) + 1]))
    for name, edges in rows:
        pred = float(x.sum()) / sum(e.padded for e in evaluate_boundaries(x, edges, T, B))
        sim = simulated(x, edges)
        fixed = fixed_b_estimate(x, edges)
        print(
            f"   {name:<8} {100 * pred:>7.2f}% {100 * sim:>7.2f}% {100 * (pred - sim):>+7.2f}"
            f" {100 * fixed:>7.2f}% {100 * (fixed - sim):>+7.2f}"
        )

    print("\n3. compare (2 epochs; pair repeat = co-batched pairs of epoch 0 seen again in 1)")
    print(
        f"   {'strategy':<22} {'pad eff':>8} {'budget':>8} {'steps/ep':>9} {'max padded':>10}"
        f" {'pairs/ep':>11} {'repeat':>8}"
    )
    seed_edges = rows[-1][1]
    samplers = [
        (
            "sorted (static)",
            BatchSampler(x, strategy="sorted", token_budget=T, max_batch=B, seed=0),
        ),
        ("random", BatchSampler(x, strategy="random", token_budget=T, max_batch=B, seed=0)),
        (
            "bucketed seed bounds",
            BatchSampler(x, boundaries=seed_edges, token_budget=T, max_batch=B, seed=0),
        ),
        (
            "bucketed DP K=6",
            BatchSampler(x, boundaries=plan.boundaries, token_budget=T, max_batch=B, seed=0),
        ),
        (
            "pool-sort 3200",
            BatchSampler(
                x, strategy="pool-sort", token_budget=T, max_batch=B, seed=0, pool_size=3200
            ),
        ),
    ]
    for name, sampler in samplers:
        r = measure(sampler, epochs=2)
        print(
            f"   {name:<22} {100 * r.padding_efficiency:>7.2f}% {100 * r.budget_use:>7.2f}%"
            f" {r.steps_per_epoch:>9,.0f} {r.largest_padded_batch:>10,} {r.pairs_per_epoch:>11,}"
            f" {100 * (r.pair_repeat or 0):>7.3f}%"
        )
    search_sections(x, args.exact_seed)


if __name__ == "__main__":
    main()
