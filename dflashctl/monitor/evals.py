"""Held-out evaluation as the panes show it: the last eval, the tau curve, the best checkpoint."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflashctl.monitor.state import RunState
from trainer.events import (
    EvalEvent,
)

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, slots=True)
class BestCheckpoint:
    """The best held-out evaluation so far: its step, tau and checkpoint (what is known)."""

    step: int | None
    tau: float | None
    checkpoint: str | None


def last_eval(state: RunState) -> EvalEvent | None:
    """The newest evaluation known: the last `Eval:` line read, or run-state.json's
    `last_eval` when that is newer (the follow started past older lines, or is behind)."""
    seen = state.evals[-1] if state.evals else None
    polled = state.run_info.last_eval
    if polled is not None and (seen is None or polled.step > seen.step):
        return polled
    return seen


def tau_history(state: RunState) -> list[tuple[int, float]]:
    """(step, simulated tau) of each evaluation read (oldest first), plus run-state.json's
    last eval when no line carried it; steps increase (a resume's re-evaluation replaces)."""
    points: dict[int, float] = {}
    evals = list(state.evals)
    newest = last_eval(state)
    if newest is not None and (not evals or newest.step > evals[-1].step):
        evals.append(newest)
    for ev in evals:
        if ev.tau is not None:
            points[ev.step] = ev.tau
    return sorted(points.items())


def best_checkpoint(state: RunState) -> BestCheckpoint | None:
    """The trainer's best (run-state.json: best_step, best_tau, best_checkpoint), else what the
    eval lines say (`best=` of the newest, its tau from the history); None before any eval."""
    info = state.run_info
    if info.best_step is not None:
        tau = info.best_tau
        if tau is None:
            tau = dict(tau_history(state)).get(info.best_step)
        return BestCheckpoint(info.best_step, tau, info.best_checkpoint)
    newest = last_eval(state)
    if newest is None:
        return None
    history = tau_history(state)
    if newest.best is not None:
        return BestCheckpoint(newest.best, dict(history).get(newest.best), None)
    if not history:
        return None
    step, tau = max(history, key=lambda p: (p[1], p[0]))  # ties to the later step
    return BestCheckpoint(step, tau, None)
