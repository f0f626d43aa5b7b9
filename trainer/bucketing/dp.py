"""Globally optimal bucket boundaries: a segmentation DP over candidate edges.

A bucket's expected padding depends only on the lengths inside it, so the total for K buckets is a
sum of segment costs and the optimum over all boundary sets on a candidate grid is an O(K C^2)
dynamic program once the C^2 / 2 segment costs are known (no local search, no restarts). With few
distinct lengths every distinct length is a candidate (the exact continuous optimum); otherwise the
candidates are a regular grid and segment costs use a histogram of `resolution`-token bins (each bin
represented by its mean length, real tokens exact). The chosen boundaries are then re-scored at full
resolution by the caller. Per-bucket constraints (minimum share of samples) are infinite costs,
so the DP stays exact under them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from trainer.bucketing.estimate import estimate_bucket

EXACT_CANDIDATES = 192  # up to this many distinct lengths, every one is a candidate edge


@dataclass(frozen=True)
class Grid:
    """Candidate edges and the binned histogram the DP scores segments on."""

    edges: np.ndarray  # int64 candidate boundaries, edges[0] = min length, edges[-1] = max + 1
    bin_of_edge: np.ndarray  # first bin index at or above each edge
    rep: np.ndarray  # float64 bin representative (mean length)
    count: np.ndarray  # int64 samples per bin
    tokens: np.ndarray  # int64 real tokens per bin
    top: np.ndarray  # int64 longest sample per bin


def make_grid(lengths: np.ndarray, max_candidates: int = 128, resolution: int = 16) -> Grid:
    """Candidate edges: every distinct length when there are few, else a power-of-two grid."""
    x = np.asarray(lengths, dtype=np.int64)
    lo, hi = int(x.min()), int(x.max()) + 1
    distinct = np.unique(x)
    if len(distinct) <= max(max_candidates, EXACT_CANDIDATES):
        edges = np.append(distinct, hi)
        bins = edges
    else:
        step = 1
        while (hi - lo) / step > max_candidates:
            step *= 2
        edges = _edges(lo, hi, step)
        bins = _edges(lo, hi, max(1, min(resolution, step)))
    idx = np.searchsorted(bins, x, side="right") - 1
    nb = len(bins) - 1
    count = np.bincount(idx, minlength=nb).astype(np.int64)
    tokens = np.bincount(idx, weights=x, minlength=nb).astype(np.int64)
    top = np.zeros(nb, dtype=np.int64)
    last = np.searchsorted(distinct, bins[1:], side="left") - 1  # largest distinct < bin end
    top[count > 0] = distinct[last[count > 0]]
    keep = count > 0
    bin_start = np.cumsum(np.r_[0, keep.astype(np.int64)])  # bins kept before each bin edge
    bin_of_edge = bin_start[np.searchsorted(bins, edges)]
    rep = tokens[keep] / count[keep]
    return Grid(edges, bin_of_edge, rep, count[keep], tokens[keep], top[keep])


def _edges(lo: int, hi: int, step: int) -> np.ndarray:
    inner = np.arange((lo // step + 1) * step, hi, step, dtype=np.int64)
    return np.concatenate(([lo], inner, [hi])).astype(np.int64)


def segment_costs(
    grid: Grid, token_budget: int, max_batch: int, min_count: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Expected padded tokens for every candidate segment [edge i, edge j); inf where forbidden.

    Returns (cost, count) as (C+1, C+1) float64 / int64 matrices (upper triangle used). A segment
    with fewer than `min_count` samples (at least 1: no empty buckets) is forbidden.
    """
    n_e = len(grid.edges)
    cost = np.full((n_e, n_e), np.inf)
    counts = np.zeros((n_e, n_e), dtype=np.int64)
    ccount = np.concatenate(([0], np.cumsum(grid.count)))
    ctok = np.concatenate(([0], np.cumsum(grid.tokens)))
    for i in range(n_e - 1):
        a = grid.bin_of_edge[i]
        for j in range(i + 1, n_e):
            b = grid.bin_of_edge[j]
            n = int(ccount[b] - ccount[a])
            counts[i, j] = n
            if n < max(min_count, 1):
                continue
            est = estimate_bucket(
                grid.rep[a:b],
                grid.count[a:b],
                token_budget,
                max_batch,
                tokens=int(ctok[b] - ctok[a]),
                max_len=int(grid.top[b - 1]),
            )
            cost[i, j] = est.padded
    return cost, counts


def optimal_segmentations(cost: np.ndarray, k_max: int) -> dict[int, tuple[float, list[int]]]:
    """For each K = 1..k_max: (minimum total cost, edge indices 0 = i_0 < ... < i_K = C).

    F_k(j) = min_i F_(k-1)(i) + cost[i, j]; K values that admit no finite solution are omitted.
    """
    n_e = len(cost)
    best = np.full(n_e, np.inf)
    best[0] = 0.0
    back: list[np.ndarray] = []
    out: dict[int, tuple[float, list[int]]] = {}
    for k in range(1, k_max + 1):
        total = best[:, None] + cost  # total[i, j] = F_(k-1)(i) + w(i, j)
        arg = np.argmin(total, axis=0)
        best = total[arg, np.arange(n_e)]
        back.append(arg)
        if np.isfinite(best[-1]):
            path = [n_e - 1]
            for kk in range(k, 0, -1):
                path.append(int(back[kk - 1][path[-1]]))
            out[k] = (float(best[-1]), path[::-1])
    return out
