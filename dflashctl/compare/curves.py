"""A run's curves from its status.log (pure): training loss from the status lines, held-out tau
and loss from the Eval lines, each at its step and, where the trainer printed it (`tokens=`),
the real tokens trained by then.

status.log is appended across runs. A run begins with a start that resumes nothing (a
`Loading` phase not followed by `Resuming from checkpoint:` before `Starting pipeline...`: a
first start, a `--fresh` one, or one with no checkpoint to resume); a resumed start (an
operator's, the supervisor's) continues the run it resumes. A point at step s replaces the
run's points at s and after (a resume from an older checkpoint redoes those steps: the later
curve is the run's).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from trainer.events import TOKENS_KEY, EvalEvent, PhaseEvent, StatusEvent, parse_line


@dataclass(frozen=True)
class Point:
    """One measurement: its step, the tokens trained by then (None: not printed), its value."""

    step: int
    tokens: int | None
    value: float


@dataclass
class RunCurves:
    """One run of a status.log: its curves, oldest point first."""

    loss: list[Point] = field(default_factory=list)  # training loss (status lines)
    tau: list[Point] = field(default_factory=list)  # held-out simulated tau (Eval lines)
    eval_loss: list[Point] = field(default_factory=list)  # held-out loss (Eval lines)
    resumes: int = 0  # resumed starts within the run

    @property
    def last_step(self) -> int | None:
        steps = [s[-1].step for s in (self.loss, self.tau) if s]
        return max(steps) if steps else None

    @property
    def last_tokens(self) -> int | None:
        known = [p.tokens for p in (*self.loss[-1:], *self.tau[-1:]) if p.tokens is not None]
        return max(known) if known else None

    @property
    def has_tokens(self) -> bool:
        """Every point carries its tokens (a trainer older than `tokens=` printed none)."""
        points = [*self.loss, *self.tau]
        return bool(points) and all(p.tokens is not None for p in points)

    @property
    def empty(self) -> bool:
        return not (self.loss or self.tau)


def _add(series: list[Point], point: Point) -> None:
    while series and series[-1].step >= point.step:
        series.pop()
    series.append(point)


def _tokens(extra: dict[str, str]) -> int | None:
    text = extra.get(TOKENS_KEY, "")
    return int(text) if text.isdigit() else None


def split_runs(lines: Iterable[str]) -> list[RunCurves]:
    """The runs of a status.log, oldest first (runs that never printed a point left out)."""
    runs: list[RunCurves] = []
    current: RunCurves | None = None
    resuming = False
    for line in lines:
        ev = parse_line(line.rstrip("\n"))
        if isinstance(ev, PhaseEvent):
            if ev.phase == "loading":
                resuming = False
            elif ev.phase == "resuming":
                resuming = True
            elif ev.phase == "starting":
                if resuming and current is not None:
                    current.resumes += 1
                else:
                    current = RunCurves()
                    runs.append(current)
                resuming = False
        elif isinstance(ev, StatusEvent | EvalEvent):
            if current is None:  # a log whose first run printed no phase line
                current = RunCurves()
                runs.append(current)
            tokens = _tokens(ev.extra)
            if isinstance(ev, StatusEvent):
                if ev.loss is not None:
                    _add(current.loss, Point(ev.step, tokens, ev.loss))
                continue
            if ev.tau is not None:
                _add(current.tau, Point(ev.step, tokens, ev.tau))
            if ev.loss is not None:
                _add(current.eval_loss, Point(ev.step, tokens, ev.loss))
    return [r for r in runs if not r.empty]
