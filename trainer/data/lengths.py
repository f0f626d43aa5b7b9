"""Sample-length arrays: the seed-shaped synthetic distribution and loading lengths from disk.

The planner, the sampler, their tests and `make demo` all need realistic lengths without the seed's
private data. `seed_shaped_lengths` rebuilds the distribution of the seed run from its published
percentiles (../shared/reference/bucketing.md §3.1): a monotone piecewise interpolation of the
quantile function in which Box-Cox(lambda)-transformed lengths are linear in p inside each piece,
with lambda bisected so the total is exactly 1,866,000,000 tokens over 902,087 samples. Between the
knots the shape is a guess; the knots, count and total are the seed's. numpy only, int64 results.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

import numpy as np
from numpy.typing import NDArray

from trainer.errors import TrainerError

SEED_N = 902_087
SEED_TOTAL_TOKENS = 1_866_000_000
SEED_KNOTS: tuple[tuple[float, int], ...] = (
    (0.00, 65),
    (0.10, 637),
    (0.25, 1035),
    (0.50, 1727),
    (0.75, 2912),
    (0.90, 4200),
    (0.95, 4374),
    (0.99, 4917),
    (1.00, 8191),
)
Variant = Literal["primary", "thin"]


class LengthsError(TrainerError, ValueError):
    """A lengths file or array is unusable; the message names the file and the problem."""


def _boxcox(x: np.ndarray, lam: float) -> np.ndarray:
    return np.asarray(np.log(x) if abs(lam) < 1e-12 else (np.power(x, lam) - 1.0) / lam)


def _inv_boxcox(y: np.ndarray, lam: float) -> np.ndarray:
    return np.asarray(np.exp(y) if abs(lam) < 1e-12 else np.power(lam * y + 1.0, 1.0 / lam))


class _Grid:
    """Per-sample piece index and position, computed once; only lambda varies during the fit."""

    def __init__(self, n: int, variant: Variant) -> None:
        ps = np.array([k[0] for k in SEED_KNOTS])
        self.qs = np.array([float(k[1]) for k in SEED_KNOTS])
        p = np.arange(n, dtype=np.float64) / max(n - 1, 1)
        self.piece = np.clip(np.searchsorted(ps, p, side="right") - 1, 0, len(ps) - 2)
        self.t = (p - ps[self.piece]) / (ps[self.piece + 1] - ps[self.piece])
        self.top = np.zeros(n, dtype=bool)
        if variant == "thin":
            # Top 1 % concentrated just above P99: Q = 4917 + 3274 u^12 (P99.9 ~ 5842).
            self.top = p >= ps[-2]
            u = (p[self.top] - ps[-2]) / (1.0 - ps[-2])
            self.top_q = self.qs[-2] + (self.qs[-1] - self.qs[-2]) * u**12

    def sample(self, lam: float) -> np.ndarray:
        """Rounded lengths (int64, ascending) for one lambda."""
        knots = _boxcox(self.qs, lam)
        lo, hi = knots[self.piece], knots[self.piece + 1]
        q = _inv_boxcox(lo + self.t * (hi - lo), lam)
        if self.top.any():
            q[self.top] = self.top_q
        lengths: NDArray[np.int64] = np.clip(np.rint(q), self.qs[0], self.qs[-1]).astype(np.int64)
        return lengths


def seed_shaped_lengths(n: int = SEED_N, seed: int = 0, variant: Variant = "primary") -> np.ndarray:
    """Synthetic lengths shaped like the seed run's 902,087 samples (int64, shuffled by `seed`).

    Stratified quantiles p_i = i/(n-1) through the published percentile knots; lambda is bisected so
    the mean is 1.866e9 / 902,087 (for n = 902,087 the total is then exactly 1,866,000,000 tokens).
    The order is a seeded permutation so slices are representative subsamples.

    Args:
        n: number of samples (>= 2).
        seed: permutation seed; the multiset of lengths does not depend on it.
        variant: "primary" (bucketing.md §3.1) or "thin" (top 1 % squeezed towards P99, §3.9).
    """
    if n < 2:
        raise LengthsError(f"seed_shaped_lengths: n must be >= 2, got {n}")
    if variant not in ("primary", "thin"):
        raise LengthsError(f"seed_shaped_lengths: unknown variant {variant!r}")
    _, ordered = fit_lambda(n, variant)
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, 0x1E9])))
    return ordered[rng.permutation(n)]


@lru_cache(maxsize=4)
def fit_lambda(n: int = SEED_N, variant: Variant = "primary") -> tuple[float, np.ndarray]:
    """Find the Box-Cox lambda whose rounded lengths sum to the seed's total (scaled to n).

    Returns (lambda, ascending lengths, read-only). The total rises monotonically with lambda
    (geometric pieces sit below linear ones) and one rounding flip moves it by one token, so an
    Illinois false-position search lands on the exact integer total in a few evaluations.
    """
    grid = _Grid(n, variant)
    target = round(SEED_TOTAL_TOKENS * n / SEED_N)
    lo, hi = -1.0, 2.0
    f_lo: float = int(grid.sample(lo).sum()) - target
    f_hi: float = int(grid.sample(hi).sum()) - target
    mid, best, side = lo, grid.sample(lo), 0
    for _ in range(100):
        mid = hi - f_hi * (hi - lo) / (f_hi - f_lo) if f_hi != f_lo else 0.5 * (lo + hi)
        if not lo < mid < hi:
            mid = 0.5 * (lo + hi)
        best = grid.sample(mid)
        f_mid = int(best.sum()) - target
        if f_mid == 0 or hi - lo < 1e-15:
            break
        if (f_mid < 0) == (f_lo < 0):
            lo, f_lo = mid, f_mid
            f_hi = f_hi / 2 if side == -1 else f_hi
            side = -1
        else:
            hi, f_hi = mid, f_mid
            f_lo = f_lo / 2 if side == 1 else f_lo
            side = 1
    best.setflags(write=False)
    return mid, best


def _check(arr: np.ndarray, source: str) -> np.ndarray:
    """Validate a lengths array: 1-D, non-empty, integer-valued, all >= 1."""
    if arr.ndim != 1:
        raise LengthsError(f"{source}: expected a 1-D array of lengths, got shape {arr.shape}")
    if arr.size == 0:
        raise LengthsError(f"{source}: no lengths (empty array)")
    if arr.dtype.kind == "f":
        if not np.all(np.isfinite(arr)) or not np.all(arr == np.floor(arr)):
            bad = int(np.flatnonzero(~np.isfinite(arr) | (arr != np.floor(arr)))[0])
            raise LengthsError(f"{source}: non-integer length {arr[bad].item()!r} at index {bad}")
    elif arr.dtype.kind not in "iu":
        raise LengthsError(f"{source}: lengths must be integers, got dtype {arr.dtype}")
    out = arr.astype(np.int64)
    if out.min() < 1:
        bad = int(np.argmin(out))
        raise LengthsError(f"{source}: length {out[bad]} at index {bad} is < 1")
    return out


def as_lengths(lengths: np.ndarray | list[int], source: str = "lengths") -> np.ndarray:
    """Validate an in-memory lengths sequence and return it as int64 (a copy)."""
    return _check(np.asarray(lengths), source)


def load_lengths(path: str | Path) -> np.ndarray:
    """Load sample lengths (int64) from a `.npy` file or a token-store directory (`lengths.i32`).

    Raises:
        LengthsError: one line naming the file: missing, unreadable, wrong shape or dtype,
            non-integer or non-positive lengths.
    """
    p = Path(path)
    if p.is_dir():
        f = p / "lengths.i32"
        if not f.is_file():
            raise LengthsError(f"{p}: not a token store (no lengths.i32)")
        size = f.stat().st_size
        if size % 4:
            raise LengthsError(f"{f}: size {size} is not a multiple of 4 bytes (int32)")
        return _check(np.fromfile(f, dtype="<i4"), str(f))
    if not p.exists():
        raise LengthsError(f"{p}: no such file")
    try:
        arr = np.load(p, allow_pickle=False)
    except (OSError, ValueError, EOFError) as exc:
        raise LengthsError(f"{p}: not a readable .npy array ({exc})") from None
    if not isinstance(arr, np.ndarray):
        raise LengthsError(f"{p}: expected one array, got {type(arr).__name__}")
    return _check(arr, str(p))
