"""Which checkpoint a run resumes from, whether it may, and where in the plan that is.

`--resume auto` takes the newest loadable, complete, finite checkpoint; newer ones that are not
are named (ERROR lines) and moved to `checkpoints/rejected/`. `--resume PATH|STEP` takes that
one, and sets aside the newer ones (the timeline being abandoned). `--fresh` archives them all.
The position resumed at is the plan's micro-batch sequence number (`BatchPlan.load_state_dict`).

Only global rank 0 looks at its run dir: it decides (a checkpoint, none, or a refusal) and the
decision with the whole state reaches every other rank through torch.distributed
(`checkpoint_sync.share_state`), so nodes without shared storage resume the same step from
node 0's checkpoint, and a copy another node may hold is never read.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from trainer.config import ConfigError, TrainConfig, resume_critical_changes
from trainer.pipeline import assets, checkpoint, checkpoint_sync, distributed
from trainer.pipeline.build import Parts, RunOptions
from trainer.pipeline.checkpointer import Checkpointer
from trainer.pipeline.launch_env import mark_launch
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
    """The checkpoint to resume from (None: start from scratch); rank 0 only calls it."""
    run_dir = opts.run_dir
    found = checkpoint.list_checkpoints(run_dir)
    if opts.fresh:
        if world.is_main and found:
            dest = checkpoint.archive_checkpoints(run_dir)
            reporter.line(f"Archived old checkpoints to {dest}", status_log=False)
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
            f"({_why(changed, old, p.cfg)}); use --fresh to archive the checkpoints and restart"
        )
    if state["world_size"] != p.world.size:
        raise assets.UserError(
            f"{path}: cannot resume: changed world_size {state['world_size']} -> "
            f"{p.world.size} (written by {state['world_size']} rank(s), this run has "
            f"{p.world.size}): the data order would change; use --fresh"
        )
    # Nodes x ranks per node may change (the data is sharded by global rank), but a rank
    # restores the CUDA RNGs of every device its writer saw: their count must match.
    saved = state["rng"][p.world.rank].get("cuda")
    if saved is not None and torch.cuda.is_available():
        have = torch.cuda.device_count()
        if len(saved) != have:
            topo = state.get("topology") or {}
            was = topo.get("local_world_size", "?")
            raise assets.UserError(
                f"{path}: cannot resume: changed rng.cuda ({len(saved)} CUDA device(s) per "
                f"rank when written, {have} now; topology.local_world_size {was} -> "
                f"{p.world.local_size}): the random streams would change; use --fresh"
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


def _why(changed: list[str], old: TrainConfig, new: TrainConfig) -> str:
    """What the changed resume-critical keys break: the loss (named both ways) and/or the
    data order or model shape."""
    loss = [k for k in changed if k == "model.loss" or k.startswith("model.loss.")]
    why = ["data order or model shape"] if len(loss) < len(changed) else []
    if loss:
        was, now = old.model.loss.label(), new.model.loss.label()
        why.append(f"the checkpoint trained loss {was}, this config {now}")
    return "; ".join(why)


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


def _comm_device(p: Parts) -> torch.device:
    if p.world.distributed and dist.get_backend() == "nccl":
        return p.drafter_device
    return torch.device("cpu")


def resume(opts: RunOptions, p: Parts, ckpt: Checkpointer, reporter: Reporter) -> int:
    """Load the checkpoint `opts` asks for into the parts; the step it holds (0: none). Rank 0
    decides and shares the decision and the state; a refusal is every rank's."""
    world = p.world
    choice: Choice | None = None
    refusal: assets.UserError | checkpoint.CheckpointError | None = None
    seq = 0
    if world.is_main:
        try:
            choice = choose(opts, world, reporter)
            if choice is not None:
                seq = check_compatible(opts.config, p, choice.path, choice.state)
            mark_launch(opts.run_dir)  # a restart within this launch resumes `auto` from now on
        except (assets.UserError, checkpoint.CheckpointError) as exc:
            refusal, choice = exc, None
    header = {
        "refused": str(refusal) if refusal else None,
        "path": str(choice.path) if choice else None,
    }
    got, state = checkpoint_sync.share_state(
        choice.state if choice else None, header, world, _comm_device(p)
    )
    if refusal is not None:
        raise refusal
    if got["refused"]:
        raise assets.UserError(str(got["refused"]))
    if state is None:
        return 0
    path = Path(str(got["path"]))
    if not world.is_main:
        seq = check_compatible(opts.config, p, path, state)
    step = ckpt.load(path, state, seq)
    distributed.barrier(world)  # every rank has its state before any moves
    skipped = choice.skipped if choice else ()
    _set_aside(skipped, world, reporter)
    detail = f"step={step} path={path}"
    if skipped:
        detail += " skipped=" + ",".join(k.path.name for k in skipped)
    reporter.phase("resuming", detail)
    return step
