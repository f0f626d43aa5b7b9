"""Expected padded tokens of one bucket under the sampler's own rule (greedy packing of a shuffle).

Why not the textbook estimate: a fixed batch size b with E[max of b] from order statistics
("rule (c)" in ../shared/reference/bucketing.md) misses the greedy packer by up to ~1 pp, because
greedy batches vary in size and, crucially, the sample that overflows a batch *starts the next
one*. That sample is biased towards long lengths, so the next batch is smaller than a fresh one.

Model: a shuffled bucket is (nearly) an i.i.d. stream with the bucket's empirical CDF F. A batch
whose first sample is x0 reaches size m iff m * max(x0, X_2..X_m) <= T (and m <= B), so it depends
on x0 only through its class c(x0) = min(B, T // x0): the largest batch x0 alone allows. Batches
therefore form a Markov renewal process on classes (<= B states): from class c0 the batch ends at
size m and the overflowing sample y (class c1) opens the next batch with probability

    P(size = m, next = y | c0) = p_y * ([m <= c0] F(a_m)^(m-1) - [m+1 <= min(c0, c1)] F(a_(m+1))^(m-1)),

with a_m = T // m (and no second term at m = B, where the next start is a fresh draw). The
stationary class distribution pi, the expected batch size and the expected padded tokens
E[size * max] per class give padded tokens per sample by the renewal-reward theorem:
E_pi[size * max] / E_pi[size]. Truncated expectations use summation by parts over the support:
E[M 1{M <= a}] = a' F(a')^e - sum_{v < a'} F(v)^e with a' = min(a, max), exact for integer lengths.

Ignored on purpose: drawing without replacement (O(b/n) per batch) and the one short batch at the
end of each bucket. Measured against the sampler on the seed-shaped data (benchmarks/bench_buckets.py) this is within
0.07 pp for every boundary set tried (the fixed-b rule: up to 1.1 pp). Float64 and int64 throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class BucketEstimate:
    """Predicted outcome of packing one bucket greedily for one epoch."""

    count: int  # samples
    tokens: int  # real tokens (int64 exact)
    padded: float  # expected padded tokens
    batches: float  # expected number of batches
    max_len: int

    @property
    def efficiency(self) -> float:
        return self.tokens / self.padded if self.padded else 1.0

    @property
    def mean_batch_size(self) -> float:
        return self.count / self.batches if self.batches else 0.0


def histogram(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Distinct lengths (float64 support points) and their counts (int64)."""
    values, counts = np.unique(np.asarray(lengths, dtype=np.int64), return_counts=True)
    return values.astype(np.float64), counts.astype(np.int64)


def estimate_bucket(
    values: np.ndarray,
    counts: np.ndarray,
    token_budget: int,
    max_batch: int,
    tokens: int | None = None,
    max_len: int | None = None,
) -> BucketEstimate:
    """Expected padded tokens and batches of one bucket under greedy packing (see module doc).

    Args:
        values: ascending support points (the bucket's distinct lengths, or bin representatives).
        counts: samples at each support point (> 0).
        token_budget, max_batch: the sampler's T and B. Every value must be <= T.
        tokens, max_len: exact real-token total and longest sample, when `values` are binned.
    """
    u = np.asarray(values, dtype=np.float64)
    cnt = np.asarray(counts, dtype=np.int64)
    n = int(cnt.sum())
    if n == 0:
        return BucketEstimate(0, 0, 0.0, 0.0, 0)
    real = int(tokens) if tokens is not None else int(np.dot(cnt, u.astype(np.int64)))
    top = int(max_len) if max_len is not None else int(u[-1])
    T, B = int(token_budget), int(max_batch)
    p = cnt / n
    F = np.cumsum(cnt) / n
    F[-1] = 1.0
    cls = np.minimum(B, (T // np.ceil(u)).astype(np.int64))  # class: largest m with u <= T // m
    c_max = int(cls[0])
    # Sizes below c_min = T // max can never end a batch (every sample fits): those rows add
    # exactly 1 to E[size] and nothing else, so only m in [c_min, c_max] is computed.
    c_min = min(int(cls[-1]), c_max)
    m = np.arange(c_min, c_max + 1, dtype=np.int64)
    e = (m - 1).astype(np.float64)[:, None]
    Fe = np.exp(e * np.log(F)[None, :])  # F_i^(m-1), shape (M, R)
    gaps = np.diff(u)
    Z = np.zeros_like(Fe)  # Z[e, i] = sum_{j < i} gap_j F_j^e  (= sum over support below u_i)
    if len(u) > 1:
        Z[:, 1:] = np.cumsum(Fe[:, :-1] * gaps[None, :], axis=1)

    def trunc(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """F(a)^(m-1) and a' F(a')^(m-1) - Z(a') per row m, for thresholds a (one per m)."""
        ap = np.minimum(a.astype(np.float64), u[-1])
        i = np.searchsorted(u, ap, side="right") - 1
        ok = i >= 0
        ii = np.maximum(i, 0)
        rows = np.arange(len(m))
        f_e = np.where(ok, Fe[rows, ii], 0.0)
        z = Z[rows, ii] + (ap - u[ii]) * Fe[rows, ii]
        return f_e, np.where(ok, ap * f_e - z, 0.0)

    a1 = T // m
    a2 = T // (m + 1)
    is_last = m == B
    f1, t1 = trunc(a1)
    f2, t2 = trunc(a2)
    f2 = np.where(is_last, 0.0, f2)
    F_a2 = np.where(is_last, 0.0, _cdf_at(u, F, a2))  # P(fresh sample <= a_(m+1))

    # Per-class averages of Z at the first sample x0 (classes are contiguous, descending).
    starts = np.flatnonzero(np.r_[True, cls[1:] != cls[:-1]])
    cvals = cls[starts]
    Pc = np.add.reduceat(p, starts)
    EZ = np.add.reduceat(Z * p[None, :], starts, axis=1) / Pc[None, :]  # (M, S)

    le1 = (m[:, None] <= cvals[None, :]).astype(np.float64)  # x0 allows size m
    le2 = ((m[:, None] + 1) <= cvals[None, :]).astype(np.float64) * (~is_last)[:, None]
    G = le1 * f1[:, None]  # P(size >= m | c0)
    H = le2 * f2[:, None]  # P(max of first m <= a_(m+1) | c0)
    EM1 = le1 * (t1[:, None] + EZ)
    EM2 = le2 * (t2[:, None] + EZ)
    reward = (m[:, None] * (EM1 - F_a2[:, None] * EM2)).sum(axis=0)  # E[size * max | c0]
    esize = G.sum(axis=0) + (c_min - 1)  # E[size | c0]

    # Transition between classes: K[c0, c1] = P_c1 * (sum_m G - sum_{m <= c1 - 1} H).
    cumH = np.vstack([np.zeros((1, len(cvals))), np.cumsum(H, axis=0)])  # cumH[k] = rows m<=k
    k_idx = np.clip(cvals - c_min, 0, len(m))  # rows m <= c1 - 1
    K = (G.sum(axis=0)[:, None] - cumH[k_idx].T) * Pc[None, :]
    pi = _stationary(K)
    per_sample = float(pi @ reward) / float(pi @ esize)
    batches = n / float(pi @ esize)
    return BucketEstimate(n, real, per_sample * n, batches, top)


def _cdf_at(u: np.ndarray, F: np.ndarray, a: np.ndarray) -> np.ndarray:
    i = np.searchsorted(u, a.astype(np.float64), side="right") - 1
    return np.where(i >= 0, F[np.maximum(i, 0)], 0.0)


def _stationary(K: np.ndarray) -> np.ndarray:
    """Stationary distribution of a row-stochastic matrix (rows renormalized against rounding)."""
    s = len(K)
    if s == 1:
        return np.ones(1)
    K = K / K.sum(axis=1, keepdims=True)
    A = np.vstack([(K.T - np.eye(s))[:-1], np.ones((1, s))])
    b = np.zeros(s)
    b[-1] = 1.0
    try:
        pi = np.linalg.solve(A, b)
    except np.linalg.LinAlgError:
        pi = np.linalg.lstsq(A, b, rcond=None)[0]
    pi = np.clip(pi, 0.0, None)
    law: np.ndarray = pi / pi.sum()  # (numpy types the division as Any)
    return law
