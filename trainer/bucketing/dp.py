"""Globally optimal bucket boundaries: a segmentation DP over candidate edges.

A bucket's expected padding depends only on the lengths inside it, so the total for K buckets is a
sum of segment costs and the optimum over all boundary sets on a candidate set is an O(K C^2)
dynamic program once the C^2 / 2 segment costs are known (no local search, no restarts). Segments
are always scored on the exact length histogram (one support point per distinct length). When the
data has fewer than `max_candidates` distinct lengths every one is a candidate edge, so the DP's
optimum is the exact optimum over all boundary sets. Otherwise the candidates are a power-of-two
grid (the caller refines around the chosen cuts, `trainer.buckets`). Per-bucket constraints
(minimum share of samples) are infinite costs, so the DP stays exact under them.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from trainer.bucketing.estimate import estimate_bucket

_BAND = 16  # segments processed together have smallest classes within this many sizes

# Candidate-edge budget: every distinct length is a candidate while they fit (the exact search;
# ~9 s CPU for K = 6 on 2,048 distinct lengths, grows as their square: docs/benchmarks.md). Real
# stores have a few thousand distinct lengths at most.
DEFAULT_CANDIDATES = 2048
# Above that, the coarse grid's edge count (16-token steps over lengths up to 8,192), refined
# around the chosen cuts by the caller.
GRID_CANDIDATES = 512
# The cost per segment grows with the batch sizes m and the classes min(B, T // length) the
# lengths span (an (ends x sizes) @ (sizes x classes) product per start); both budgets above were
# measured at 59 sizes x 59 classes (T = 49,152, B = 64, lengths up to 8,192).
# `default_candidates` shrinks them as sqrt(59 * 59 / (sizes * classes)) beyond that.
REFERENCE_WORK = 59 * 59


def batch_classes(lengths: np.ndarray, token_budget: int, max_batch: int) -> tuple[int, int]:
    """(batch sizes, classes) the model spans: max - min + 1 of min(B, T // length), and how
    many distinct values it takes over the lengths."""
    d = np.unique(np.asarray(lengths, dtype=np.int64))
    cls = np.unique(np.minimum(int(max_batch), int(token_budget) // d))
    return int(cls[-1] - cls[0] + 1), len(cls)


def default_candidates(lengths: np.ndarray, token_budget: int, max_batch: int) -> int:
    """DEFAULT_CANDIDATES, scaled down for lengths whose segments cost more than the benchmark's."""
    sizes, classes = batch_classes(lengths, token_budget, max_batch)
    scale = min(1.0, (REFERENCE_WORK / (sizes * classes)) ** 0.5)
    return max(64, int(DEFAULT_CANDIDATES * scale))


@dataclass(frozen=True)
class Grid:
    """Candidate edges and the length histogram the DP scores segments on."""

    edges: np.ndarray  # int64 candidate boundaries, edges[0] = min length, edges[-1] = max + 1
    bin_of_edge: np.ndarray  # first histogram bin at or above each edge
    rep: np.ndarray  # float64 distinct lengths (support points)
    count: np.ndarray  # int64 samples per distinct length
    tokens: np.ndarray  # int64 real tokens per distinct length
    top: np.ndarray  # int64 longest sample per bin (= the length)
    exact: bool  # every distinct length is a candidate edge
    step: int  # grid spacing in tokens (1 when exact)

    @property
    def num_distinct(self) -> int:
        return len(self.rep)


def make_grid(
    lengths: np.ndarray,
    max_candidates: int = DEFAULT_CANDIDATES,
    extra_edges: Iterable[int] = (),
    grid_candidates: int = GRID_CANDIDATES,
) -> Grid:
    """Candidate edges: every distinct length when they fit in `max_candidates` edges, else a
    power-of-two grid of at most min(max_candidates, grid_candidates) edges, plus `extra_edges`
    (the refinement windows around chosen cuts)."""
    x = np.asarray(lengths, dtype=np.int64)
    distinct, count = np.unique(x, return_counts=True)
    lo, hi = int(distinct[0]), int(distinct[-1]) + 1
    exact = len(distinct) + 1 <= max(max_candidates, 2)
    step = 1
    if exact:
        edges = np.append(distinct, hi)
    else:
        grid_max = max(min(max_candidates, grid_candidates), 2)
        while (hi - lo) / step + 1 > grid_max:
            step *= 2
        edges = _edges(lo, hi, step)
    extra = np.asarray(list(extra_edges), dtype=np.int64)
    if len(extra):
        edges = np.union1d(edges, extra[(extra > lo) & (extra < hi)])
    return Grid(
        edges=edges.astype(np.int64),
        bin_of_edge=np.searchsorted(distinct, edges, side="left"),
        rep=distinct.astype(np.float64),
        count=count.astype(np.int64),
        tokens=(distinct * count).astype(np.int64),
        top=distinct.astype(np.int64),
        exact=exact,
        step=step,
    )


def _edges(lo: int, hi: int, step: int) -> np.ndarray:
    inner = np.arange((lo // step + 1) * step, hi, step, dtype=np.int64)
    return np.concatenate(([lo], inner, [hi])).astype(np.int64)


def segment_costs(
    grid: Grid, token_budget: int, max_batch: int, min_count: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """Expected padded tokens for every candidate segment [edge i, edge j); inf where forbidden.

    Returns (cost, count) as (C+1, C+1) float64 / int64 matrices (upper triangle used). A segment
    with fewer than `min_count` samples (at least 1: no empty buckets) is forbidden. Costs for all
    ends j of one start i are computed together (`_costs_from`); runtime in docs/benchmarks.md.
    """
    cost, counts, _ = segment_stats(grid, token_budget, max_batch, min_count)
    return cost, counts


def segment_stats(
    grid: Grid, token_budget: int, max_batch: int, min_count: int = 1
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`segment_costs` plus the expected number of batches of every segment (the per-step
    term of the time objective, `trainer.bucketing.timecost`); inf where forbidden."""
    n_e = len(grid.edges)
    bins = np.concatenate(([0], np.cumsum(grid.count)))[grid.bin_of_edge]
    counts = np.triu(bins[None, :] - bins[:, None], 1).astype(np.int64)
    rows = [_costs_from(grid, i, token_budget, max_batch, min_count) for i in range(n_e)]
    cost = np.vstack([r[0] for r in rows])
    batches = np.vstack([r[1] for r in rows])
    return cost, counts, batches


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
) -> tuple[np.ndarray, np.ndarray]:
    """Expected padded tokens and batches of segments [edge i, edge j) for every j > i at once.

    Same model as `estimate_bucket` (module doc of `trainer.bucketing.estimate`), restructured so
    no (segment x size x class) array is ever built:
    * every sum over batch sizes m <= c (a class) is a cumulative sum over m, gathered per class;
    * the per-class averages of Z (the first sample's share of the max) are one matrix product
      (segments x sizes) @ (sizes x classes) on cumulative sums of the histogram;
    * the stationary class law comes from an O(S) recurrence (`stationary_min_kernel`), not an
      S x S solve, because the transition kernel depends on (c0, c1) only through min(c0, c1);
    * quantities like F_j(v)^(m-1) = (cc_v / n_j)^(m-1) are computed as (cc_v / N)^(m-1) times
      (N / n_j)^(m-1) with one reference N per piece of segments whose n_j lie within a factor
      rho of it, so neither factor overflows (underflow only drops terms below 1e-65);
    * rows m below a segment's smallest class add exactly 1 to E[size] and nothing else, so
      segments are processed in pieces whose smallest classes are within 16 of each other.
    """
    T, B = int(token_budget), int(max_batch)
    a = int(grid.bin_of_edge[i])
    n_e = len(grid.edges)
    out = np.full(n_e, np.inf)
    out_b = np.full(n_e, np.inf)
    if a >= len(grid.rep):
        return out, out_b
    cnt_all = grid.count[a:]
    CC_all = np.concatenate(([0], np.cumsum(cnt_all)))
    R_all = grid.bin_of_edge[i + 1 :] - a
    n_all = np.where(R_all > 0, CC_all[np.maximum(R_all, 0)], 0)
    valid = (R_all > 0) & (n_all >= max(1, min_count))
    if not valid.any():
        return out, out_b
    R_j = R_all[valid]
    n_j = n_all[valid].astype(np.float64)
    r_max = int(R_j[-1])
    u = grid.rep[a : a + r_max]
    cnt = cnt_all[:r_max].astype(np.float64)
    CC = CC_all[: r_max + 1]
    cls = np.minimum(B, (T // np.ceil(u)).astype(np.int64))
    new_cls = np.r_[True, cls[1:] != cls[:-1]]
    cls_of_bin = np.cumsum(new_cls) - 1
    starts = np.flatnonzero(new_cls)
    ends = np.r_[starts[1:], len(u)]
    cvals = cls[starts]
    log_cc = np.log(CC[1:].astype(np.float64))
    log_n = np.log(n_j)
    c_max = int(cls[0])
    log_rho = 560.0 / max(c_max - 1.0, 1.0)  # (N_ref / n_j)^(m-1) stays below e^560
    c_end = cls[R_j - 1]  # each segment's smallest class: rows m below it are trivial
    res = np.empty(len(R_j))
    res_b = np.empty(len(R_j))
    hi = len(R_j)
    while hi > 0:
        # one piece: n_j within a factor rho of the largest, smallest classes within _BAND of it
        ref = log_n[hi - 1]
        lo = int(np.searchsorted(log_n, ref - log_rho, side="left"))
        lo = max(lo, int(np.searchsorted(-c_end, -(c_end[hi - 1] + _BAND), side="right")))
        c_lo = int(c_end[hi - 1])
        s_n = int(np.searchsorted(-cvals, -c_lo, side="right"))  # classes with value >= c_lo
        m = np.arange(c_lo, c_max + 1, dtype=np.int64)
        sl = slice(lo, hi)
        res[sl], res_b[sl] = _chunk(
            u,
            cnt,
            CC,
            log_cc,
            R_j[sl],
            n_j[sl],
            log_n[sl],
            ref,
            m,
            m - 1.0,
            B,
            T,
            cls_of_bin,
            starts[:s_n],
            ends[:s_n],
            cvals[:s_n],
        )
        hi = lo
    full = np.full(len(valid), np.inf)
    full[valid] = res
    out[i + 1 :] = full
    full_b = np.full(len(valid), np.inf)
    full_b[valid] = res_b
    out_b[i + 1 :] = full_b
    return out, out_b


def _chunk(
    u: np.ndarray,
    cnt: np.ndarray,
    CC: np.ndarray,
    log_cc: np.ndarray,
    R_j: np.ndarray,
    n_j: np.ndarray,
    log_n: np.ndarray,
    ref: float,
    m: np.ndarray,
    e: np.ndarray,
    B: int,
    T: int,
    cls_of_bin: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    cvals: np.ndarray,
) -> tuple[np.ndarray, np.ndarray]:
    """Padded tokens and batches of the segments ending at bins R_j (n_j within a factor rho of
    exp(ref))."""
    r = int(R_j[-1])
    u, cnt, log_cc = u[:r], cnt[:r], log_cc[:r]
    M, J = len(m), len(R_j)
    mf = e + 1.0
    c_lo = int(m[0])
    # Scaled sums: P~ = (cc / N_ref)^e, W~[k] = sum_{l<k} gap_l P~_l, V~[k] = sum_{l<k} cnt_l W~_l.
    Pt = np.exp(e[:, None] * (log_cc[None, :] - ref))  # (M, r); underflow is harmless
    Wt = np.zeros((M, r))
    if r > 1:
        np.cumsum(Pt[:, :-1] * np.diff(u)[None, :], axis=1, out=Wt[:, 1:])
    Vt = np.zeros((M, r + 1))
    np.cumsum(cnt[None, :] * Wt, axis=1, out=Vt[:, 1:])
    scale = np.exp((ref - log_n)[:, None] * e[None, :])  # (J, M): (N_ref / n_j)^e
    rows = np.arange(M)[None, :]
    top = u[R_j - 1]

    def trunc(thr: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Per (j, m): F(a)^(m-1), a' F(a')^(m-1) - Z(a'), F(a), thresholds a = thr[m]."""
        idx0 = np.searchsorted(u, thr.astype(np.float64), side="right") - 1  # (M,)
        ok = (idx0 >= 0)[None, :]
        idx = np.clip(np.minimum(idx0[None, :], R_j[:, None] - 1), 0, None)  # (J, M)
        ap = np.minimum(thr[None, :].astype(np.float64), top[:, None])
        f_e = np.where(ok, Pt[rows, idx] * scale, 0.0)
        z = Wt[rows, idx] * scale
        t = np.where(ok, ap * f_e - (z + (ap - u[idx]) * f_e), 0.0)
        return f_e, t, np.where(ok, CC[idx + 1] / n_j[:, None], 0.0)

    is_last = (m == B)[None, :]
    f1, t1, _ = trunc(T // m)
    f2, t2, F_a2 = trunc(T // (m + 1))
    f2 = np.where(is_last, 0.0, f2)
    F_a2 = np.where(is_last, 0.0, F_a2)
    S = len(cvals)
    ci = cvals - c_lo
    zeros = np.zeros((J, 1))
    g = np.cumsum(f1, axis=1)[:, ci]  # sum_{m <= c} f1: P(size >= m) summed
    phi = np.concatenate([zeros, np.cumsum(f2, axis=1)], axis=1)[:, ci]  # sum_{m < c} f2
    A = np.cumsum(mf * t1, axis=1)[:, ci]
    A -= np.concatenate([zeros, np.cumsum(mf * F_a2 * t2, axis=1)], axis=1)[:, ci]
    hi = np.minimum(ends[None, :], R_j[:, None])
    ccount = (CC[hi] - CC[np.minimum(starts[None, :], hi)]).astype(np.float64)
    present = ccount > 0
    # E[Z] part of the reward: sum_{m < c} beta_m EZ[m, c] + c EZ[c, c], beta = m (1 - F(a_(m+1)))
    bs = mf[None, :] * (1.0 - F_a2) * scale
    ez = np.zeros((J, S))
    s_f = int(np.searchsorted(ends, r, side="right"))  # classes some segment holds whole
    if s_f:
        D = Vt[:, ends[:s_f]] - Vt[:, starts[:s_f]]  # (M, S_f), times N_ref^-e
        P = bs @ (D * (m[:, None] < cvals[None, :s_f]))
        P += cvals[None, :s_f] * scale[:, ci[:s_f]] * D[ci[:s_f], np.arange(s_f)][None, :]
        ez[:, :s_f] = np.where(ends[None, :s_f] <= R_j[:, None], P, 0.0)
    sp = cls_of_bin[R_j - 1]  # the class the segment end cuts
    part = np.flatnonzero(ends[sp] > R_j)
    if len(part):
        cs = cvals[sp[part]]
        d = (Vt[:, R_j[part]] - Vt[:, starts[sp[part]]]).T  # (Jp, M), times N_ref^-e
        val = (bs[part] * d * (m[None, :] < cs[:, None])).sum(axis=1)
        k = np.arange(len(part)), cs - c_lo
        ez[part, sp[part]] = val + cs * scale[part][k] * d[k]
    ez = np.where(present, ez / np.where(present, ccount, 1.0), 0.0)
    pc = ccount / n_j[:, None]
    pi = stationary_min_kernel(g, phi, pc)
    mean_size = (pi * (g + (c_lo - 1))).sum(axis=1)  # E_pi[batch size]
    cost: np.ndarray = n_j * (pi * (A + ez)).sum(axis=1) / mean_size
    batches: np.ndarray = n_j / mean_size
    return cost, batches


def stationary_min_kernel(g: np.ndarray, phi: np.ndarray, pc: np.ndarray) -> np.ndarray:
    """Stationary law of K[s0, s1] = pc[s1] (g[s0] - phi[max(s0, s1)]) / r[s0], one per row.

    Classes are indexed by descending value, so max(s0, s1) is the smaller class: the transition
    of the greedy packer (a batch opened by class c0 overflows on a sample of class c1; phi sums
    P(first m fit under a_(m+1)) over m < min(c0, c1)). With q = pi / pc, differences of
    consecutive balance equations give q[s+1] = q[s] - (phi[s+1] - phi[s]) L[s], where
    L[s] = sum_{t <= s} pi[t] / r[t]: a homogeneous recurrence, so start at q[0] = 1 and
    normalize. q only grows (phi falls with s), so there is no cancellation. Absent classes
    (pc = 0) get 0. Tested against a dense solve.
    """
    J, S = pc.shape
    tot = pc.sum(axis=1, keepdims=True)
    cum_pc = np.cumsum(pc, axis=1)
    tail = np.zeros((J, S))
    if S > 1:
        tail[:, :-1] = np.cumsum((pc * phi)[:, :0:-1], axis=1)[:, ::-1]
    r = g * tot - phi * cum_pc - tail
    w = pc / np.where(r > 0, r, 1.0)
    dphi = np.diff(phi, axis=1)
    q = np.empty((S, J))
    qt, wt, dt = q, w.T.copy(), dphi.T.copy()
    qt[0] = 1.0
    L = wt[0].copy()
    for s in range(1, S):
        qt[s] = qt[s - 1] - dt[s - 1] * L
        L += wt[s] * qt[s]
    pi = pc * q.T
    law: np.ndarray = pi / pi.sum(axis=1, keepdims=True)  # (numpy types the division as Any)
    return law
