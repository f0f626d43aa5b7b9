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
    with fewer than `min_count` samples (at least 1: no empty buckets) is forbidden. Costs for all
    ends j of one start i are computed together (`_costs_from`): ~1 s CPU for C = 128.
    """
    n_e = len(grid.edges)
    bins = np.concatenate(([0], np.cumsum(grid.count)))[grid.bin_of_edge]
    counts = np.triu(bins[None, :] - bins[:, None], 1).astype(np.int64)
    cost = np.vstack([_costs_from(grid, i, token_budget, max_batch, min_count) for i in range(n_e)])
    return cost, counts


def reference_segment_costs(
    grid: Grid, token_budget: int, max_batch: int, min_count: int = 1
) -> np.ndarray:
    """`segment_costs` one segment at a time through `estimate_bucket` (slow; for tests)."""
    n_e = len(grid.edges)
    cost = np.full((n_e, n_e), np.inf)
    for i in range(n_e - 1):
        a = grid.bin_of_edge[i]
        for j in range(i + 1, n_e):
            b = grid.bin_of_edge[j]
            if int(grid.count[a:b].sum()) < max(min_count, 1):
                continue
            est = estimate_bucket(
                grid.rep[a:b],
                grid.count[a:b],
                token_budget,
                max_batch,
                tokens=int(grid.tokens[a:b].sum()),
                max_len=int(grid.top[b - 1]),
            )
            cost[i, j] = est.padded
    return cost


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


def _costs_from(
    grid: Grid, i: int, token_budget: int, max_batch: int, min_count: int
) -> np.ndarray:
    """Expected padded tokens of segments [edge i, edge j) for every j > i at once.

    Same model as `estimate_bucket`, but every quantity that depends on the segment end j only
    through the normalizer n_j is shared: sum_{l<k} gap_l F_j(l)^e = n_j^-e * W[e, k] with
    W = sum gap_l cc_l^e accumulated once in log space (cc = counts from edge i up), and the
    per-class sums of Z likewise. Per segment only an (M x S) gather and an S x S solve remain.
    """
    T, B = int(token_budget), int(max_batch)
    a = int(grid.bin_of_edge[i])
    u, cnt = grid.rep[a:], grid.count[a:]
    n_e = len(grid.edges)
    out = np.full(n_e, np.inf)
    if len(u) == 0:
        return out
    R_j = grid.bin_of_edge[i + 1 :] - a  # bins in each segment
    cc = np.cumsum(cnt)
    CC = np.concatenate(([0], cc))
    n_j = np.where(R_j > 0, CC[R_j], 0)
    valid = (R_j > 0) & (n_j >= max(1, min_count))
    if not valid.any():
        return out
    R_j, n_j = R_j[valid], n_j[valid].astype(np.float64)
    log_n = np.log(n_j)
    cls = np.minimum(B, (T // np.ceil(u)).astype(np.int64))
    c_lo, c_max = int(cls[-1]), int(cls[0])
    m = np.arange(c_lo, c_max + 1, dtype=np.int64)
    e = (m - 1).astype(np.float64)
    log_cc = np.log(cc.astype(np.float64))
    gaps = np.diff(u)
    # logW[e, k] = log sum_{l<k} gap_l cc_l^e ; logV[e, k] = log sum_{l<k} cnt_l W[e, l]
    with np.errstate(divide="ignore"):
        terms = np.log(gaps)[None, :] + e[:, None] * log_cc[None, :-1]
        logW = np.full((len(m), len(u)), -np.inf)
        if len(u) > 1:
            logW[:, 1:] = np.logaddexp.accumulate(terms, axis=1)
        logV = np.full((len(m), len(u) + 1), -np.inf)
        logV[:, 1:] = np.logaddexp.accumulate(np.log(cnt.astype(np.float64)) + logW, axis=1)

    def trunc(thr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (m, j): F(a)^(m-1), a' F(a')^(m-1) - Z(a'), and F(a) for thresholds a (per m)."""
        idx0 = np.searchsorted(u, thr.astype(np.float64), side="right") - 1
        ok = (idx0 >= 0)[:, None]
        idx = np.clip(np.minimum(idx0[:, None], R_j[None, :] - 1), 0, None)  # (M, J)
        ap = np.minimum(thr[:, None].astype(np.float64), u[R_j - 1][None, :])
        logF = log_cc[idx] - log_n[None, :]
        f_e = np.where(ok, np.exp(e[:, None] * logF), 0.0)
        z = np.exp(logW[np.arange(len(m))[:, None], idx] - e[:, None] * log_n[None, :])
        t = np.where(ok, ap * f_e - (z + (ap - u[idx]) * f_e), 0.0)
        return f_e, t, np.where(ok, np.exp(logF), 0.0)

    is_last = (m == B)[:, None]
    f1, t1, _ = trunc(T // m)
    f2, t2, F_a2 = trunc(T // (m + 1))
    f2 = np.where(is_last, 0.0, f2)
    F_a2 = np.where(is_last, 0.0, F_a2)

    starts = np.flatnonzero(np.r_[True, cls[1:] != cls[:-1]])
    ends = np.r_[starts[1:], len(u)]
    cvals = cls[starts]
    hi = np.minimum(ends[None, :], R_j[:, None])  # (J, S) class range end inside segment
    lo = np.minimum(starts[None, :], hi)
    ccount = (CC[hi] - CC[lo]).astype(np.float64)  # samples per class per segment
    present = ccount > 0
    Pc = ccount / n_j[:, None]  # (J, S)
    shift = e[None, :, None] * log_n[:, None, None]  # (J, M, 1)
    sumz = np.exp(logV[:, hi].transpose(1, 0, 2) - shift)  # (J, M, S)
    sumz -= np.exp(logV[:, lo].transpose(1, 0, 2) - shift)
    EZ = np.where(present[:, None, :], sumz / np.where(present, ccount, 1.0)[:, None, :], 0.0)

    le1 = (m[:, None] <= cvals[None, :]).astype(np.float64)  # (M, S)
    le2 = ((m[:, None] + 1) <= cvals[None, :]).astype(np.float64) * (~is_last)
    f1t, f2t, t1t, t2t, Fa2t = (v.T[:, :, None] for v in (f1, f2, t1, t2, F_a2))  # (J, M, 1)
    G = le1[None] * f1t
    H = le2[None] * f2t
    EM1 = le1[None] * (t1t + EZ)
    EM2 = le2[None] * (t2t + EZ)
    reward = (m[None, :, None] * (EM1 - Fa2t * EM2)).sum(axis=1)  # (J, S)
    esize = G.sum(axis=1) + (c_lo - 1)
    cumH = np.concatenate([np.zeros((len(R_j), 1, len(cvals))), np.cumsum(H, axis=1)], axis=1)
    k_idx = np.clip(cvals - c_lo, 0, len(m))
    K = (G.sum(axis=1)[:, :, None] - cumH[:, k_idx, :].transpose(0, 2, 1)) * Pc[:, None, :]
    pi = _stationary_batch(K, present)
    padded = n_j * (pi * reward).sum(axis=1) / (pi * esize).sum(axis=1)
    res = np.full(len(valid), np.inf)
    res[valid] = padded
    out[i + 1 :] = res
    return out


def _stationary_batch(K: np.ndarray, present: np.ndarray) -> np.ndarray:
    """Stationary distributions of a batch of row-stochastic matrices (absent states get 0)."""
    j, s, _ = K.shape
    rows = K.sum(axis=2, keepdims=True)
    K = np.where(rows > 0, K / np.where(rows > 0, rows, 1.0), 0.0)
    # pi (K - I) = 0 with sum(pi) = 1 replacing the first state's equation (the first class is
    # always present); absent states have zero in-flow, so their equations force pi = 0.
    A = np.transpose(K, (0, 2, 1)) - np.eye(s)[None]
    A[:, 0, :] = 1.0
    b = np.zeros((j, s, 1))
    b[:, 0] = 1.0
    try:
        pi = np.linalg.solve(A, b)[:, :, 0]
    except np.linalg.LinAlgError:
        pi = np.stack([np.linalg.lstsq(A[t], b[t, :, 0], rcond=None)[0] for t in range(j)])
    pi = np.clip(np.where(present, pi, 0.0), 0.0, None)
    return pi / pi.sum(axis=1, keepdims=True)
