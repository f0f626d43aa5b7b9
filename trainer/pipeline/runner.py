"""The training run: build the parts, start the stages, train, monitor, checkpoint, stop cleanly.

Threads (one process per data-parallel rank):

    prefetch[w]  store rows -> padded tensors -> q_pre[bucket]         (bounded, per bucket)
    target[d]    claim next seq -> q_pre[bucket] -> frozen target on device d -> reorder buffer
    drafter      reorder buffer (strict seq order) -> `train_step` -> checkpoints   (`train`)
    main         status line every status.interval_s, signals, failure handling   (`Monitor`)

M:N (`topology.targets = "shared"`, `trainer.pipeline.topology`): the target devices are
processes of their own; in a drafter rank one `receiver` thread stands in for the target
threads (features from its target rank, in sequence order, into a one-deep reorder buffer).

Any exception in any thread sets the shared stop event (every blocking op polls it), the run
prints the traceback and one ERROR line, and exits 1. SIGINT/SIGTERM ask the drafter to finish
its step, write a checkpoint and stop; a second signal stops at once: no more data is waited
for, and the last completed step is still checkpointed when the drafter is not stuck (what
happened is recorded in run-state.json as `stop_detail`). Once the stop is recorded, further
signals are ignored, so a late Ctrl-C cannot turn a completed stop into a signal death
(`trainer.pipeline.signals`).

Resume (`--resume auto`) takes the newest loadable, complete, finite checkpoint; newer ones
that are not are named (ERROR lines) and moved to `checkpoints/rejected/` (`resume`). A
checkpoint that cannot be written (non-finite state, full disk) is one ERROR line and the
earlier ones stay (`Checkpointer`); training goes on, but not for long with nothing saved: once
`MAX_FAILED_IN_A_ROW` writes failed in a row, the next step is checkpointed at once (space may
have come back) and, if that fails too, the run stops with exit 3 (`ExitCode.UNSAVED`, which
the supervisor never restarts) rather than spend GPU-hours on steps no checkpoint will hold.

Read top to bottom: `run` (the CLI's body and the run-state it leaves), `_run` (setup, stages,
monitor, how it ended), `setup`, `start_stages`, `train` (the drafter's loop).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

import torch

from trainer.config import ConfigError, TrainConfig, config_hash
from trainer.errors import ExitCode
from trainer.model.target import TargetModel
from trainer.pipeline import assets, checkpoint, checkpoint_sync, distributed, topology
from trainer.pipeline.attention_choice import choose_attention
from trainer.pipeline.build import Parts, RunOptions, build_parts
from trainer.pipeline.channels import ReorderBuffer, Stopped
from trainer.pipeline.checkpointer import Checkpointer, NonFiniteState, RngState
from trainer.pipeline.evals import EvalReports, build_evaluator, quiet_hf, record_holdout
from trainer.pipeline.evaluate import Best, EvalResult, InTraining
from trainer.pipeline.faults import FaultPlan
from trainer.pipeline.monitor import Monitor, Queues
from trainer.pipeline.reduce import StepFlags
from trainer.pipeline.resume import resume
from trainer.pipeline.signals import StopSignals
from trainer.pipeline.stages import (
    Claims,
    Packet,
    Stager,
    Supervisor,
    prefetch_body,
    target_body,
)
from trainer.pipeline.status import Board, NodeInfo, Reporter, RunRecord, RunStateFile
from trainer.pipeline.step import Feed, StepResult, autocast_for, train_step
from trainer.pipeline.track import TrackerSink


class NonFiniteLoss(RuntimeError):
    """Too many consecutive non-finite losses: the run is diverging."""


# Failures the run explains in its ERROR line; a traceback would only bury it.
EXPLAINED = (NonFiniteLoss, NonFiniteState)


def _release() -> str:
    """The deployed release hash when running from WORKDIR/releases/<hash>/, else 'dev'."""
    env = os.environ.get("DFLASH_RELEASE")
    if env:
        return env
    parts = Path(__file__).resolve().parts
    if "releases" in parts:
        i = parts.index("releases")
        if i + 1 < len(parts):
            return parts[i + 1]
    return "dev"


@dataclass
class Run:
    """The wiring of one training process (one data-parallel rank). Made before anything can
    fail, so every exit path can record how the run ended."""

    opts: RunOptions
    cfg: TrainConfig
    world: distributed.World
    reporter: Reporter
    record: RunRecord
    sup: Supervisor = field(default_factory=Supervisor)
    faults: FaultPlan = field(default_factory=FaultPlan)
    board: Board = field(default_factory=Board)
    t0: float = field(default_factory=time.monotonic)
    signals: StopSignals = field(init=False)
    tracker: TrackerSink = field(init=False)
    ckpt: Checkpointer | None = None  # once the parts are built
    links: topology.Links | None = None  # M:N: features from the target ranks
    completed: bool = False  # the drafter trained to the end of the plan
    final_save_failed: bool = False  # the last step's checkpoint was not written
    unsaved: str | None = None  # why the run stopped because checkpoints kept failing

    def __post_init__(self) -> None:
        self.signals = StopSignals(self.reporter, self.sup.stop)
        self.tracker = TrackerSink(self.reporter)

    @property
    def saved_step(self) -> int:
        return self.ckpt.saved_step if self.ckpt else 0

    def stop_detail(self) -> str | None:
        name = self.ckpt.saved_name if self.ckpt else "no checkpoint"
        return self.signals.detail(self.board.step, self.saved_step, name)


@dataclass
class Training:
    """What `setup` built: the parts, loaded from the resumed checkpoint, and their helpers."""

    p: Parts
    ckpt: Checkpointer
    monitor: Monitor
    evaluator: InTraining | None
    evals: EvalReports | None
    start_step: int
    start_micro: int
    end_micro: int


def run(opts: RunOptions) -> int:
    """The CLI's body: returns the process exit status."""
    try:
        cfg = TrainConfig.load(opts.config)
    except ConfigError as exc:
        print(f"ERROR: {exc}", flush=True)
        return ExitCode.USAGE
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    try:
        world = distributed.init_world(cfg.topology)
    except assets.UserError as exc:
        print(f"ERROR: {exc}", flush=True)
        return ExitCode.USAGE
    if isinstance(world, distributed.TargetRank):  # M:N: this process captures, not trains
        return topology.serve(cfg, world)
    reporter = Reporter(opts.run_dir, enabled=world.is_main, rank=world.process)
    # every node's first local rank keeps its node's run-state (node 0's is the run's)
    node = NodeInfo.from_env()
    record = RunRecord(RunStateFile(opts.run_dir), reporter, world.local_rank == 0, node)
    r = Run(opts, cfg, world, reporter, record)
    if world.layout is not None:  # every process of the launch joins the features group
        r.links = topology.connect(world)
    record.step_of = lambda: r.board.step
    newest = checkpoint.list_checkpoints(opts.run_dir)[-1:]
    # Every field the trainer owns, written whole (a corrupted file is replaced, not merged).
    r.record(
        pid=os.getpid(),
        parent_pid=os.getppid(),
        config_hash=config_hash(cfg),
        release=_release(),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        state="starting",
        exit_status=None,
        world_size=world.size,
        last_step=newest[0][0] if newest else None,
        last_checkpoint=str(newest[0][1]) if newest else None,
        checkpoint_error=None,
        checkpoint_failed=None,
        checkpoint_failures=0,
        stop_signal=None,
        signals=0,
        stop_detail=None,
        lost_steps=0,
        last_error=None,
    )
    if opts.fresh or not cfg.eval.enabled:
        # a fresh start archives the checkpoints (best.pt with them); without [eval] nothing
        # would ever overwrite the last run's figures: neither may show as this run's
        r.record(
            last_eval=None,
            eval_rows=None,
            eval_seconds=None,
            eval_share=None,
            best_step=None,
            best_tau=None,
            best_checkpoint=None,
        )
    r.signals.install()
    status = ExitCode.FAILED
    escaped: Exception | None = None  # raised outside the stages (setup's collectives)
    try:
        status = _run(r)
        return status
    except Exception as exc:
        escaped = exc
        raise
    finally:
        received = r.signals.received
        if r.signals.stopped and status == ExitCode.OK:
            state = "stopped"
        elif status == ExitCode.OK:
            state = "finished"
        elif status == ExitCode.USAGE:
            state = "refused"
        elif received and r.sup.failure is None:
            state = "stopped"  # a signalled stop that could not keep every step (see detail)
        else:
            state = "crashed"
        failure = r.sup.failure[1] if r.sup.failure else escaped
        if node is None:
            failed_rank = None
        elif failure is not None:
            failed_rank = checkpoint_sync.first_failed_rank(failure, world)
        elif state == "refused":  # its own refusal: the others' collectives fail after it
            failed_rank = checkpoint_sync.publish_failure(world.process)
        else:
            failed_rank = None
        r.record(
            state=state,
            exit_status=int(status),
            step=r.board.step,
            failed_rank=failed_rank,
            peer_failure=checkpoint_sync.peer_failure(failure) if failure is not None else None,
            stop_signal=received[0].name if received else None,
            signals=len(received),
            stop_detail=r.unsaved or r.stop_detail(),
            lost_steps=max(0, r.board.step - r.saved_step),
            last_error=r.reporter.last_error,
        )
        r.signals.ignore()
        r.tracker.close()  # finished, stopped or failed: after the last status line
        r.reporter.close()
        distributed.close_world(world)


def _run(r: Run) -> ExitCode:
    try:
        t = setup(r)
    except (assets.UserError, checkpoint.CheckpointError) as exc:
        r.reporter.error(str(exc))
        return ExitCode.USAGE
    r.reporter.phase("starting")
    if r.links is not None:
        topology.start_targets(r.world, r.links, t.start_micro, t.end_micro)
    queues, drafter = start_stages(r, t)
    p = t.p
    r.record(
        state="running",
        last_step=t.start_step,
        last_checkpoint=str(t.ckpt.saved_path) if t.ckpt.saved_path else None,
        total_steps=p.schedule.total_steps,
        end_step=p.schedule.end_step,
        warmup_steps=p.schedule.warmup_steps,
        boundaries=list(p.sampler.boundaries) if p.sampler.num_buckets > 1 else None,
    )
    r.reporter.phase("running")
    try:
        t.monitor.loop(queues, drafter, r.sup.stop, r.signals, r.record, t.end_micro)
    except Stopped:
        pass
    except BaseException as exc:
        r.sup.fail("monitor", exc)
    return _finish(r, t, queues, drafter)


def _finish(r: Run, t: Training, queues: Queues, drafter: threading.Thread) -> ExitCode:
    """Wait for the stages, then say how the run ended (and export a finished drafter)."""
    sig = r.signals
    if sig.requested.is_set():
        sig.announce()  # both signals may land within one monitor poll
    if sig.second_stops_at_once:
        name = sig.received[1].name
        r.reporter.phase("stopping", f"second {name}: stopping at once, no more steps")
    # A stop waits 5 s for the drafter, but does not interrupt a checkpoint being written
    # unless a third signal insists (a hung filesystem).
    deadline = time.monotonic() + 5
    while drafter.is_alive():
        drafter.join(0.1)
        insist = len(sig.received) > 2 or not t.ckpt.saving
        if r.sup.stop.is_set() and insist and time.monotonic() > deadline:
            break
    r.sup.stop.set()
    stuck = r.sup.join(timeout=5.0)
    if r.sup.failure is not None:
        stage, err, tb = r.sup.failure
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        explained = isinstance(err, EXPLAINED)
        r.reporter.error(
            f"stage {stage} failed: {type(err).__name__}: {first}", None if explained else tb
        )
        return ExitCode.FAILED
    if stuck:
        r.reporter.error(f"stages did not stop within 5 s: {', '.join(stuck)}")
    step = r.board.step
    if r.unsaved is not None:
        r.reporter.error(r.unsaved)
        return ExitCode.UNSAVED
    if r.final_save_failed:
        lost = step - t.ckpt.saved_step
        start = f"resuming from {t.ckpt.saved_name}" if t.ckpt.saved_path else "starting over"
        r.reporter.error(
            f"stopped at step {step} without its checkpoint: {start} repeats {lost} step(s)"
        )
        return ExitCode.FAILED
    if sig.stopped and t.ckpt.saved_step >= step:
        r.reporter.phase("stopping", f"done at step {step} ({sig.name})")
        return ExitCode.OK
    if sig.received and not r.completed:
        r.reporter.error(f"stopped by {sig.name}: {r.stop_detail()}")
        return ExitCode.FAILED
    if not r.completed:
        r.reporter.error("pipeline stopped before the end of the plan")
        return ExitCode.FAILED
    t.monitor.emit(queues, t.end_micro, time.monotonic(), None)
    if r.world.is_main:  # the plan's end or [schedule] max_steps: both ends the user asked for
        _export(r, t.p)
    r.reporter.phase("finished", f"step={step}")
    return ExitCode.OK


def _export(r: Run, p: Parts) -> None:
    """The finished drafter to RUN/export, and the held-out best to RUN/export-best (each also
    as -bf16; `python -m trainer.export` writes the same from any checkpoint)."""
    from trainer.model.export import export_forms
    from trainer.model.export_files import EXPORT, EXPORT_BEST

    out, bf16 = export_forms(p.drafter, r.opts.run_dir / EXPORT)
    r.reporter.line(f"Exported drafter to {out} (bf16: {bf16})", status_log=False)
    best = checkpoint.best_checkpoint(r.opts.run_dir)
    if best is not None:  # the held-out best, alongside the last
        p.drafter.load_state_dict(checkpoint.load_checkpoint(best[1])["drafter"])
        out, _ = export_forms(p.drafter, r.opts.run_dir / EXPORT_BEST)
        r.reporter.line(f"Exported best drafter (step {best[0]}) to {out}", status_log=False)


def setup(r: Run) -> Training:
    """Build the parts, resume them, set up evaluation and trackers (UserError: refused)."""
    r.reporter.phase("loading")
    p = build_parts(r.cfg, r.world, r.opts.run_dir, r.faults)
    if len(p.holdout) and r.world.is_main:
        record_holdout(p, r.record, r.reporter)
    best = Best()
    r.ckpt = ckpt = Checkpointer(p, r.board, best, r.reporter, r.record)
    start_step = resume(r.opts, p, ckpt, r.reporter)
    evaluator = build_evaluator(p, best, r.record) if r.cfg.eval.enabled else None
    evals = EvalReports(p, evaluator, r.reporter, r.record, r.tracker) if evaluator else None
    start_micro = r.board.micro
    r.board.real_tokens = p.plan.real_tokens_before(start_micro)
    if r.world.is_main and r.cfg.tracking.backends:  # last: nothing after it can refuse the run
        from trainer.tracking import open_trackers

        r.tracker.tracker = open_trackers(
            r.cfg.tracking,
            r.opts.run_dir,
            config=r.cfg.model_dump(mode="json"),
            resume_step=start_step or None,
            notes={"loss": r.cfg.model.loss.label()},
            warn=r.reporter.warn,
        )
    monitor = Monitor(
        p, r.board, r.reporter, r.tracker, lambda: evals.last_tau if evals else None, r.t0
    )
    end_micro = p.schedule.end_step * p.accum
    return Training(p, ckpt, monitor, evaluator, evals, start_step, start_micro, end_micro)


def start_stages(r: Run, t: Training) -> tuple[Queues, threading.Thread]:
    """One prefetch thread per bucket, one target thread per target device, the drafter."""
    p, m = t.p, t.monitor
    topo = p.cfg.topology
    nb = p.sampler.num_buckets
    # M:N: packets arrive on the drafter's device, one ahead (capacity 1, nothing to stage)
    shared = r.links is not None
    hs: ReorderBuffer[Packet] = ReorderBuffer(1 if shared else topo.hidden_depth, t.start_micro)
    queues = Queues(
        pre=[queue.Queue(maxsize=topo.prefetch_depth) for _ in range(nb)],
        hs=hs,
        feed=Stager(hs, p.drafter_device, r.sup.stop, m.dft_clock, ahead=not shared),
    )
    pin = p.drafter_device.type == "cuda" or any(d.startswith("cuda") for d in p.target_devices)
    # One prefetch thread per bucket: a thread serving several buckets in sequence order
    # would block on one full queue while the others run dry (head-of-line blocking).
    for w in range(nb):
        body = prefetch_body(
            plan=p.plan,
            store=p.store,
            buckets=[w],
            queues=queues.pre,
            start_seq=t.start_micro,
            end_seq=t.end_micro,
            stop=r.sup.stop,
            clock=m.pre_clocks[w],
            faults=p.faults,
            pin=pin,
            device=p.drafter_device,
        )
        r.sup.spawn(f"prefetch[{w}]", body)
    if r.links is not None:
        body = topology.receiver_body(
            world=r.world,
            links=r.links,
            plan=p.plan,
            queues=queues.pre,
            out=queues.hs,
            start_seq=t.start_micro,
            end_seq=t.end_micro,
            width=(p.dcfg.num_features + int(p.cfg.model.loss.distills)) * p.dcfg.hidden_size,
            dtype=p.target_dtype,
            device=p.drafter_device,
            stop=r.sup.stop,
            clock=m.tgt_clocks[0],
            done=m.tgt_done,
        )
        r.sup.spawn("receiver", body)
    claims = Claims(t.start_micro, t.end_micro)
    for i, dev in enumerate(p.target_devices):

        def load(dev: str = dev) -> TargetModel:
            quiet_hf()  # bars would interleave with status lines
            return TargetModel.load(p.target_dir, p.layer_ids, dev, p.target_dtype)

        body = target_body(
            load_target=load,
            device=dev,
            plan=p.plan,
            claims=claims,
            queues=queues.pre,
            out=queues.hs,
            stop=r.sup.stop,
            clock=m.tgt_clocks[i],
            done=m.tgt_done,
            faults=p.faults,
            final=p.cfg.model.loss.distills,
        )
        r.sup.spawn(f"target[{dev}#{i}]", body)
    return queues, r.sup.spawn("drafter", lambda: train(r, t, queues.feed))


def train(r: Run, t: Training, feed: Feed) -> None:
    """The drafter's loop: step, account, evaluate, checkpoint, until the end or a stop."""
    p, ckpt, ev, sig = t.p, t.ckpt, t.evaluator, r.signals
    distributed.bind_thread(p.drafter_device)  # this thread's CUDA work goes to its own GPU
    autocast = autocast_for(p.drafter_device)
    choose_attention(p, r.reporter.warn)  # flex that does not compile: SDPA, said once
    # Line-buffered: a full disk shows at the write (one line, training goes on), not at close.
    metrics_log = (
        open(p.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
        if p.world.is_main
        else None
    )
    step, nonfinite_run = t.start_step, 0
    end = p.schedule.end_step
    ckpt.start_clock()
    if ev is not None and t.evals is not None:
        ev.start()
        if step == 0:  # the untrained baseline (no checkpoint, so never the best)
            t.evals.report(0, ev.run(p.drafter, autocast))

    def flags() -> StepFlags:
        return StepFlags(
            stop=sig.requested.is_set(),
            checkpoint_due=ckpt.time_due(),
            eval_due=ev is not None and ev.time_due(),
            checkpoints_failing=ckpt.failing,
        )

    try:
        while step < end:
            # The RNGs at the step boundary: a second signal can abandon a step halfway
            # through its micro-batches and still checkpoint the last completed one.
            rng_at_step = checkpoint.rng_state(p.gen) if p.accum > 1 else None
            try:
                res = train_step(p, feed, step, flags, autocast)
            except Stopped:
                _stop_at_once(r, ckpt, step, rng_at_step)
                raise
            if not res.finite:
                nonfinite_run += 1
                r.board.nonfinite += 1
                if nonfinite_run >= p.cfg.optimizer.max_nonfinite:
                    raise NonFiniteLoss(
                        f"{nonfinite_run} non-finite losses in a row (step {step + 1}): the run "
                        "diverged; lower optimizer.lr or check the data"
                    )
            elif res.totals.weight_sum > 0:
                nonfinite_run = 0
            step = res.step
            _account(r, p, res, metrics_log)
            stop_now = res.totals.flags.stop
            if stop_now:
                sig.announce()  # before its checkpoint line, even if the monitor is asleep
            # Checkpoints keep failing: this step's is written and waited for, one last try.
            failing = res.totals.flags.checkpoints_failing
            final = stop_now or step == end or failing
            if not _after_step(r, t, res, final, autocast):
                if failing:
                    r.unsaved = _unsaved(ckpt, step)
                return
            if stop_now:
                sig.stopped = True
                return
        r.completed = True
    finally:
        ckpt.drain()  # a stop, the end or a failure waits for the write in flight
        if r.links is not None:  # every drafter is past its last step: the targets may go
            topology.release_targets(r.world, r.links)
        if metrics_log is not None:
            with contextlib.suppress(OSError):
                metrics_log.close()


def _account(r: Run, p: Parts, res: StepResult, metrics_log: TextIO | None) -> None:
    """The step's figures on the board (status lines) and in metrics.jsonl."""
    micro = res.step * p.accum
    totals = res.totals
    r.board.q_hs = totals.depths
    r.board.add_step(
        res.step,
        micro,
        p.plan.real_tokens_before(micro),
        res.lr,
        res.gnorm,
        totals.metrics,
        totals.bucket_sums if p.sampler.num_buckets > 1 and res.finite else None,
    )
    if metrics_log is not None:
        rec = {"step": res.step, "loss": res.loss, "lr": res.lr, "gnorm": res.gnorm, "micro": micro}
        # seconds since the run started, at the end of this step's host sync: step times for
        # `python -m trainer.measure` (differences of consecutive records)
        rec["elapsed_s"] = round(time.monotonic() - r.t0, 6)
        rec["cpu_s"] = round(time.process_time(), 6)  # this process's CPU seconds, all threads
        r.reporter.append(metrics_log, json.dumps(rec) + "\n")


def _after_step(
    r: Run,
    t: Training,
    res: StepResult,
    final: bool,
    autocast: contextlib.AbstractContextManager[object],
) -> bool:
    """Evaluate and checkpoint when due; False when the loop must end (its final checkpoint
    failed). Between steps, never on a signalled stop (that must end quickly): an eval draws no
    random numbers, so the next step is what it would have been."""
    p, ckpt, ev, step = t.p, t.ckpt, t.evaluator, res.step
    flags = res.totals.flags
    evaluated: EvalResult | None = None
    new_best, prev_best = False, ckpt.best.value
    if (
        ev is not None
        and not flags.stop
        and ev.due(step, flags.eval_due, step == p.schedule.end_step)
    ):
        evaluated = ev.run(p.drafter, autocast)
        better = torch.tensor(
            [float(ev.better(step, evaluated))], dtype=torch.float64, device=p.drafter_device
        )
        new_best = distributed.all_reduce_sum(better, p.world).item() > 0
        if new_best and evaluated is not None and evaluated.tau is not None:
            ckpt.best.value = (step, evaluated.tau)  # saved with this checkpoint
    if ckpt.due(step, final=final, time_due=flags.checkpoint_due, new_best=new_best):
        saved = ckpt.save(step, wait=final or new_best)  # best.pt needs the file
        if new_best and t.evals is not None:
            t.evals.mark_best(step, saved, prev_best)
        if t.evals is not None:
            t.evals.report(step, evaluated)
        if final and not saved:
            r.final_save_failed = True
            return False
    elif t.evals is not None:
        t.evals.report(step, evaluated)
    return True


def _unsaved(ckpt: Checkpointer, step: int) -> str:
    """The ERROR line of a run stopped because its checkpoints keep failing."""
    failed = ckpt.failures
    where = checkpoint.checkpoint_dir(ckpt.p.run_dir)
    start = f"resuming from {ckpt.saved_name}" if ckpt.saved_path else "starting over"
    return (
        f"stopped at step {step}: the last {failed} checkpoints failed, so training on would "
        f"not be kept (exit {int(ExitCode.UNSAVED)}: not restarted); free space in {where} "
        f"(or fix what the checkpoint errors say), then start again: {start} repeats "
        f"{step - ckpt.saved_step} step(s)"
    )


def _stop_at_once(r: Run, ckpt: Checkpointer, step: int, rng: RngState | None) -> None:
    """The drafter was told to stop while waiting for data (a second signal): checkpoint the
    last completed step unless it is on disk already (one rank only: the others may not be at
    the same boundary, and the save's gather would hang)."""
    if not r.signals.requested.is_set() or r.sup.failure is not None:
        return  # a failure elsewhere, not a signal: the run reports that
    r.signals.stopped = True
    r.signals.announce()  # before the checkpoint line, as for a first-signal stop
    if step > ckpt.saved_step and r.world.size == 1 and not ckpt.save(step, rng):
        r.final_save_failed = True
