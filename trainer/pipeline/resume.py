"""Which checkpoint a run resumes from, whether it may, and where in the plan that is.

`--resume auto` takes the newest loadable, complete, finite checkpoint; newer ones that are not
are named (ERROR lines) and moved to `checkpoints/rejected/`. `--resume PATH|STEP` takes that
one, and sets aside the newer ones (the timeline being abandoned). `--fresh` archives them all.
The position resumed at is the plan's micro-batch sequence number (`BatchPlan.load_state_dict`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import ConfigError, TrainConfig, resume_critical_changes
from trainer.pipeline import assets, checkpoint, distributed
from trainer.pipeline.build import Parts, RunOptions
from trainer.pipeline.checkpointer import Checkpointer
from trainer.pipeline.status import Reporter


@dataclass(frozen=True)
class Choice:
    path: Path
    state: dict[str, Any]  # the loaded checkpoint
    skipped: tuple[checkpoint.Skipped, ...]  # newer checkpoints set aside, with why


def _explicit(run_dir: Path, value: str) -> Path:
    """`--resume PATH` or `--resume STEP` (digits: step-STEP.pt in RUN/checkpoints)."""
    if not value.isdigit():
        return Path(value)
    path = checkpoint.checkpoint_path(run_dir, int(value))
    if not path.is_file():
        have = [s for s, _ in checkpoint.list_checkpoints(run_dir)]
        listed = ", ".join(map(str, have)) if have else "none"
        raise checkpoint.CheckpointError(
            path, f"no checkpoint for step {int(value)} (steps here: {listed})"
        )
    return path


def choose(opts: RunOptions, world: distributed.World, reporter: Reporter) -> Choice | None:
    """The checkpoint to resume from (None: start from scratch)."""
    run_dir = opts.run_dir
    found = checkpoint.list_checkpoints(run_dir)
    if opts.fresh:
        if world.is_main and found:
            dest = checkpoint.archive_checkpoints(run_dir)
            reporter.line(f"Archived old checkpoints to {dest}", status_log=False)
        distributed.barrier(world)
        return None
    if opts.resume == "never":
        if found:
            raise assets.UserError(
                f"{checkpoint.checkpoint_dir(run_dir)}: holds checkpoints but "
                "--resume never was given: pass --fresh to archive them and start over"
            )
        return None
    if opts.resume == "auto":
        if not found:
            return None
        sel = checkpoint.select_resume(run_dir)
        if sel.path is None or sel.state is None:
            why = "; ".join(f"{k.path.name}: {k.reason}" for k in sel.skipped)
            raise assets.UserError(
                f"{checkpoint.checkpoint_dir(run_dir)}: no usable checkpoint ({why}); "
                "--resume PATH|STEP picks one, --fresh archives them and starts over"
            )
        return Choice(sel.path, sel.state, sel.skipped)
    path = _explicit(run_dir, opts.resume)
    state = checkpoint.load_checkpoint(path)
    # Newer checkpoints here belong to the timeline being abandoned: an automatic resume after
    # a crash must not jump back to them.
    step = int(state["step"])
    skipped = tuple(
        checkpoint.Skipped(p, f"newer than step {step}, resumed by --resume {opts.resume}")
        for s, p in found
        if s > step and p.resolve() != path.resolve()
    )
    return Choice(path, state, skipped)


def check_compatible(config: Path, p: Parts, path: Path, state: dict[str, Any]) -> int:
    """UserError unless `state` can continue this run; else the sequence number it resumes at."""
    try:
        old = TrainConfig.from_dict(state["config"], source=f"{path} (saved config)")
    except ConfigError as exc:
        raise assets.UserError(str(exc)) from None
    changed = resume_critical_changes(old, p.cfg)
    if changed:
        raise assets.UserError(
            f"{config}: cannot resume from {path}: changed {', '.join(changed)} "
            "(data order or model shape); use --fresh to archive the checkpoints and restart"
        )
    if state["world_size"] != p.world.size:
        raise assets.UserError(
            f"{path}: written by {state['world_size']} rank(s), this run has "
            f"{p.world.size}: the data order would change; use --fresh"
        )
    from trainer.sampler import SamplerError

    try:
        seq = p.plan.load_state_dict(state["sampler"])
    except SamplerError as exc:
        raise assets.UserError(f"{path}: {exc}") from None
    step = int(state["step"])
    if seq != min(step * p.accum, p.plan.total):
        raise assets.UserError(
            f"{path}: its sampler position (micro-batch {seq}) is not its step {step}'s "
            f"({step * p.accum}): the checkpoint is inconsistent; use --resume with another"
        )
    return seq


def _set_aside(
    skipped: tuple[checkpoint.Skipped, ...], world: distributed.World, reporter: Reporter
) -> None:
    for k in skipped:
        where = ""
        if world.is_main:
            try:
                where = f"; moved to {checkpoint.reject_checkpoint(k.path, k.reason)}"
            except OSError as exc:
                where = f"; could not move it aside: {exc.strerror or exc}"
        reporter.error(f"skipped checkpoint {k.path}: {k.reason}{where}")


def resume(opts: RunOptions, p: Parts, ckpt: Checkpointer, reporter: Reporter) -> int:
    """Load the checkpoint `opts` asks for into the parts; the step it holds (0: none)."""
    choice = choose(opts, p.world, reporter)
    if choice is None:
        return 0
    seq = check_compatible(opts.config, p, choice.path, choice.state)
    step = ckpt.load(choice.path, choice.state, seq)
    distributed.barrier(p.world)  # every rank has read its checkpoint before any moves
    _set_aside(choice.skipped, p.world, reporter)
    detail = f"step={step} path={choice.path}"
    if choice.skipped:
        detail += " skipped=" + ",".join(k.path.name for k in choice.skipped)
    reporter.phase("resuming", detail)
    return step
