"""The run's plan as the panes show it: queue capacities, steps, LR schedule, bucket edges.

The trainer's own figures (run-state.json, folded into `RunState.run_state`) win over the local
config's explicit values; nothing here re-derives what the trainer decided.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.monitor.state import RunState

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, slots=True)
class RunShape:
    """What the local run config states and panes need: the queue capacities, the epoch count,
    the LR schedule, and the values the config gives explicitly (bucket edges as a list,
    schedule.max_steps, schedule.warmup_steps). The trainer's own figures (run-state.json)
    win over those; nothing here is derived from the config the way the trainer derives it."""

    boundaries: tuple[int, ...] | None = None
    q_pre_capacity: int | None = None
    q_hs_capacity: int | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    epochs: float | None = None
    schedule: Callable[[int, int, int], float] | None = None
    """LR at (step, warmup_steps, total_steps): the trainer's own schedule, so the curve drawn is
    the one it follows."""


def shape_from_config(path: Path) -> RunShape:
    """The panes' view of a run config: explicit bucket edges, queue capacities, the LR schedule.

    An unreadable or invalid config gives an empty shape (the panes then show what status lines
    alone tell); the restart modal is where config errors are reported. Planned edges
    (`boundaries = "plan"`) are the trainer's to say, in run-state.json.
    """
    from trainer.config import ConfigError, TrainConfig

    try:
        cfg = TrainConfig.load(path)
    except ConfigError:
        return RunShape()
    bounds = cfg.batching.boundaries
    sched = cfg.schedule
    return RunShape(
        boundaries=tuple(bounds) if isinstance(bounds, list) else None,
        q_pre_capacity=cfg.topology.prefetch_depth,
        q_hs_capacity=cfg.topology.hidden_depth,
        warmup_steps=sched.warmup_steps,
        total_steps=sched.max_steps,
        epochs=sched.epochs,
        schedule=lr_schedule(cfg.optimizer.lr, sched.min_lr),
    )


def lr_schedule(peak: float, floor: float) -> Callable[[int, int, int], float]:
    """The trainer's own LR schedule (torch-free `trainer.config.schedule.lr_at`) bound to a
    config's peak and floor, so the curve drawn is the one the run follows."""
    from trainer.config.schedule import lr_at

    def at(step: int, warmup: int, total: int) -> float:
        return lr_at(step, total_steps=total, warmup_steps=warmup, peak=peak, floor=floor)

    return at


def total_steps(shape: RunShape, state: RunState) -> int | None:
    """Optimizer steps of the whole schedule as the trainer computed them (run-state.json),
    else the config's explicit max_steps; None (unknown) before either says."""
    reported = state.run_info.total_steps
    return reported if reported is not None else shape.total_steps


def end_step(state: RunState) -> int | None:
    """The step the run stops at (the schedule's end, or max_steps), as the trainer said."""
    return state.run_info.end_step


def warmup_steps(shape: RunShape, state: RunState) -> int | None:
    """Warmup length as the trainer computed it (run-state.json), else the config's explicit
    warmup_steps; None (unknown) when neither says: a ratio is the trainer's to apply."""
    reported = state.run_info.warmup_steps
    return reported if reported is not None else shape.warmup_steps


def boundaries(shape: RunShape, state: RunState) -> Sequence[int] | None:
    """Bucket edges: the ones the trainer reports (planned or configured), else the config's
    explicit list; None (b0..bN labels) when neither says."""
    reported = state.run_info.boundaries
    return reported if reported is not None else shape.boundaries
