"""Runs side by side (pure): their curves at common points of one axis (optimizer step, or real
tokens trained), and who is ahead.

The points are the first run's held-out evaluations inside the range every run reached (its
training-loss points when no run evaluated), thinned to at most `points` (the first and the
last kept). Each run's value at a point is its own measurement there, else the straight line
between its two measurements around it (marked `interpolated`); never extrapolated past what it
ran. Held-out tau is better higher, losses lower.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from dflashctl.compare.curves import Point, RunCurves

Axis = Literal["step", "tokens"]
METRICS = ("tau", "eval_loss", "loss")
HIGHER_IS_BETTER = {"tau": True, "eval_loss": False, "loss": False}
METRIC_NAMES = {"tau": "held-out tau", "eval_loss": "held-out loss", "loss": "training loss"}


@dataclass(frozen=True)
class Value:
    value: float
    interpolated: bool


@dataclass(frozen=True)
class Row:
    x: int
    values: dict[str, list[Value | None]]  # metric -> one per run


@dataclass(frozen=True)
class Lead:
    """Who is ahead on a metric at the last common point, and how often across the points."""

    metric: str
    best: int  # run index
    value: float
    runner_up: int | None
    margin: float | None  # best minus runner-up (tau) / runner-up minus best (losses): >= 0
    wins: list[int]  # per run: the points where it is ahead (ties to none)
    compared: int  # points where every run has a value


@dataclass(frozen=True)
class Alignment:
    axis: Axis
    rows: list[Row] = field(default_factory=list)
    leads: list[Lead] = field(default_factory=list)
    problem: str | None = None  # why nothing could be aligned


def label(i: int) -> str:
    """A, B, ..., Z, then R27, R28, ...: how tables name the runs."""
    return chr(ord("A") + i) if i < 26 else f"R{i + 1}"


def x_of(p: Point, axis: Axis) -> int | None:
    return p.step if axis == "step" else p.tokens


def series(points: Sequence[Point], axis: Axis) -> list[tuple[int, float]]:
    """(x, value) in x order (a later point for one x wins; tokens grow with steps)."""
    out: dict[int, float] = {}
    for p in points:
        x = x_of(p, axis)
        if x is not None:
            out[x] = p.value
    return sorted(out.items())


def value_at(xy: Sequence[tuple[int, float]], x: int) -> Value | None:
    """The measurement at x, or the line between its neighbours; None outside the range."""
    xs = [a for a, _ in xy]
    i = bisect.bisect_left(xs, x)
    if i < len(xs) and xs[i] == x:
        return Value(xy[i][1], False)
    if i == 0 or i == len(xs):
        return None
    (x0, y0), (x1, y1) = xy[i - 1], xy[i]
    return Value(y0 + (y1 - y0) * (x - x0) / (x1 - x0), True)


def thin(xs: Sequence[int], points: int) -> list[int]:
    """At most `points` of `xs`, evenly by index, the first and the last kept."""
    if len(xs) <= points:
        return list(xs)
    if points == 1:
        return [xs[-1]]
    idx = sorted({round(i * (len(xs) - 1) / (points - 1)) for i in range(points)})
    return [xs[i] for i in idx]


def _lead(metric: str, rows: Sequence[Row], runs: int) -> Lead | None:
    higher = HIGHER_IS_BETTER[metric]
    full = [r.values[metric] for r in rows if all(v is not None for v in r.values[metric])]
    if not full:
        return None
    wins = [0] * runs
    for vals in full:
        nums = [v.value for v in vals if v is not None]
        top = max(nums) if higher else min(nums)
        if nums.count(top) == 1:
            wins[nums.index(top)] += 1
    last = [v.value for v in full[-1] if v is not None]
    order = sorted(range(runs), key=lambda i: -last[i] if higher else last[i])
    best = order[0]
    second = order[1] if runs > 1 else None
    margin = None if second is None else abs(last[best] - last[second])
    return Lead(metric, best, last[best], second, margin, wins, len(full))


def align(runs: Sequence[RunCurves], axis: Axis, points: int = 12) -> Alignment:
    """The runs' curves at common points of `axis` (see the module)."""
    if axis == "tokens":
        missing = [label(i) for i, r in enumerate(runs) if not r.has_tokens]
        if missing:
            return Alignment(
                axis,
                problem=f"run {', '.join(missing)} printed no tokens= (a trainer older than "
                "it): aligned by step only",
            )
    curves = [{m: series(getattr(r, m), axis) for m in METRICS} for r in runs]
    base = "tau" if all(c["tau"] for c in curves) else "loss"
    if not all(c[base] for c in curves):
        return Alignment(axis, problem="a run has no point on this axis")
    lo = max(c[base][0][0] for c in curves)
    hi = min(c[base][-1][0] for c in curves)
    grid = [x for x, _ in curves[0][base] if lo <= x <= hi]
    if not grid:
        return Alignment(axis, problem=f"the runs share no {axis} range ({lo} > {hi})")
    rows = [
        Row(x, {m: [value_at(c[m], x) for c in curves] for m in METRICS})
        for x in thin(grid, points)
    ]
    leads = [lead for m in METRICS if (lead := _lead(m, rows, len(runs))) is not None]
    return Alignment(axis, rows, leads)
