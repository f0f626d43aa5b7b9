"""Measure batching strategies side by side by running the real sampler (no model of it).

For each strategy: padding efficiency (real / padded tokens), budget use (real tokens / steps x T),
steps per epoch, the largest padded batch, and diversity: the share of co-batched sample pairs of
one epoch that are co-batched again in the next. Packed rows hold several documents; their
padding efficiency is real / (rows x fullest row: what the collator pads to) and their row fill
real / (rows x row_length); documents sharing a row or a batch count as co-batched. Pairs are hashed to int64 keys (lo * n + hi) per
batch-size group with numpy, so ~15 M pairs per epoch cost a sort, not a Python loop.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from trainer.config import STRATEGIES
from trainer.sampler import Batch, BatchSampler, SamplerWarning

COMPARED = ("sorted", "random", "bucketed", "pool-sort", "packed")
POOL_SIZE = 3200  # pool-sort's pool: the config's default, when the data has room for it
POOLS_AT_LEAST = 4  # the default pool leaves at least this many pools per epoch


def default_pool_size(num_samples: int) -> int:
    """pool-sort's pool for `compare` when none is given: the config's 3,200, but never more
    than a quarter of the samples (a pool holding them all is the sorted strategy, not a
    pool-sort: a 2,679-row store compared 'sorted' twice)."""
    return max(1, min(POOL_SIZE, num_samples // POOLS_AT_LEAST))


@dataclass(frozen=True)
class StrategyReport:
    """Measured epoch statistics of one strategy (means over the epochs run)."""

    strategy: str
    padding_efficiency: float
    budget_use: float
    steps_per_epoch: float
    largest_padded_batch: int
    pair_repeat: float | None  # share of pairs repeating next epoch; None with one epoch
    pairs_per_epoch: int
    warnings: tuple[str, ...] = ()  # the sampler's (e.g. a pool-sort pool holding every sample)
    row_fill: float | None = None  # packed: real tokens / (rows x row_length); else None
    same_as_sorted: bool = False  # pool-sort with a pool holding every sample: it IS sorted

    def to_json_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class EpochStats:
    real: int
    padded: int
    steps: int
    largest: int


def epoch_stats(batches: Sequence[Batch]) -> EpochStats:
    """Token totals of one epoch's batches (int64 sums: totals exceed 2^31)."""
    real = int(np.sum(np.fromiter((b.real_tokens for b in batches), np.int64, len(batches))))
    padded = np.fromiter((b.padded_tokens for b in batches), np.int64, len(batches))
    return EpochStats(real, int(padded.sum()), len(batches), int(padded.max(initial=0)))


def pair_keys(batches: Sequence[Batch], n: int) -> np.ndarray:
    """Sorted int64 keys lo * n + hi of every pair of samples sharing a batch."""
    by_size: dict[int, list[np.ndarray]] = {}
    for b in batches:
        if len(b.indices) > 1:
            by_size.setdefault(len(b.indices), []).append(b.indices)
    keys = []
    for size, rows in by_size.items():
        mat = np.stack(rows).astype(np.int64)
        i, j = np.triu_indices(size, 1)
        a, c = mat[:, i], mat[:, j]
        keys.append((np.minimum(a, c) * n + np.maximum(a, c)).ravel())
    out = np.concatenate(keys) if keys else np.zeros(0, dtype=np.int64)
    out.sort()
    return out


def repeat_share(prev: np.ndarray, nxt: np.ndarray) -> float:
    """Share of `prev` pairs present in `nxt` (both sorted, unique)."""
    if len(prev) == 0:
        return 0.0
    return len(np.intersect1d(prev, nxt, assume_unique=True)) / len(prev)


def measure(sampler: BatchSampler, epochs: int) -> StrategyReport:
    """Run `epochs` epochs of one sampler (all ranks) and summarize them."""
    n = len(sampler.lengths)
    stats, repeats, pairs = [], [], []
    prev: np.ndarray | None = None
    for epoch in range(epochs):
        batches = [b for group in sampler.global_batches(epoch) for b in group]
        stats.append(epoch_stats(batches))
        if epochs > 1:
            keys = pair_keys(batches, n)
            pairs.append(len(keys))
            if prev is not None:
                repeats.append(repeat_share(prev, keys))
            prev = keys
    real = sum(s.real for s in stats)
    padded = sum(s.padded for s in stats)
    steps = sum(s.steps for s in stats)
    row_fill = None
    row_length = getattr(sampler, "row_length", None)
    if sampler.strategy == "packed" and row_length:
        rows = sum(b.num_rows for e in range(epochs) for g in sampler.global_batches(e) for b in g)
        row_fill = real / (rows * row_length)
    return StrategyReport(
        strategy=sampler.strategy,
        padding_efficiency=real / padded,
        budget_use=real / (steps * sampler.token_budget),
        steps_per_epoch=steps / epochs,
        largest_padded_batch=max(s.largest for s in stats),
        pair_repeat=float(np.mean(repeats)) if repeats else None,
        pairs_per_epoch=int(np.mean(pairs)) if pairs else 0,
        warnings=sampler.warnings,
        row_fill=row_fill,
        same_as_sorted=sampler.strategy == "pool-sort" and bool(sampler.warnings),
    )


def compare_strategies(
    lengths: np.ndarray,
    boundaries: Sequence[int],
    token_budget: int,
    max_batch: int,
    *,
    epochs: int = 2,
    seed: int = 0,
    pool_size: int = POOL_SIZE,
    row_length: int | None = None,
) -> list[StrategyReport]:
    """Sorted static, random, bucketed, pool-sort and packed batching on the same lengths (each
    strategy this sampler has, in that order); `row_length` is packed's (None: the longest)."""
    out = []
    for strategy in [s for s in COMPARED if s in STRATEGIES]:
        with warnings.catch_warnings():  # reported in the table instead (StrategyReport.warnings)
            warnings.simplefilter("ignore", SamplerWarning)
            sampler = BatchSampler(
                lengths,
                strategy=strategy,
                boundaries=boundaries,
                token_budget=token_budget,
                max_batch=max_batch,
                seed=seed,
                pool_size=pool_size,
                row_length=row_length if strategy == "packed" else None,
            )
        out.append(measure(sampler, epochs))
    return out
