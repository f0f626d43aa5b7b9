"""The training run: build the stages, run the drafter step, monitor, checkpoint, stop cleanly.

Threads (one process per data-parallel rank):

    prefetch[w]  store rows -> padded tensors -> q_pre[bucket]         (bounded, per bucket)
    target[d]    claim next seq -> q_pre[bucket] -> frozen target on device d -> reorder buffer
    drafter      reorder buffer (strict seq order) -> objective -> AdamW step -> checkpoints
    main         status line every status.interval_s, signals, failure handling

Any exception in any thread sets the shared stop event (every blocking op polls it), the run
prints the traceback and one ERROR line, and exits 1. SIGINT/SIGTERM ask the drafter to finish
its step, write a checkpoint and stop; a second signal stops at once: no more data is waited
for, and the last completed step is still checkpointed when the drafter is not stuck (what
happened is recorded in run-state.json as `stop_detail`). Once the stop is recorded, further
signals are ignored, so a late Ctrl-C cannot turn a completed stop into a signal death.

Resume (`--resume auto`) takes the newest loadable, complete, finite checkpoint; newer ones
that are not are named (ERROR lines) and moved to `checkpoints/rejected/`. A checkpoint that
cannot be written (non-finite state, full disk) is one ERROR line and the earlier ones stay.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer.config import ConfigError, TrainConfig, config_hash, resume_critical_changes
from trainer.events import EvalEvent, StatusEvent, format_eval_line, parse_line
from trainer.model.split_step import bounded_objective_backward
from trainer.model.target import TargetModel
from trainer.pipeline import assets, checkpoint, distributed
from trainer.pipeline.channels import ReorderBuffer, Stopped, WaitClock
from trainer.pipeline.evaluate import EvalResult, InTraining, capture_held_out
from trainer.pipeline.faults import FaultPlan
from trainer.pipeline.plan import BatchPlan
from trainer.pipeline.schedule import lr_at, warmup_steps_for
from trainer.pipeline.stages import (
    Claims,
    Counter,
    HostBatch,
    Packet,
    Supervisor,
    prefetch_body,
    target_body,
)
from trainer.pipeline.status import (
    Board,
    RateWindow,
    Reporter,
    RunStateFile,
    status_line,
    wait_percent,
)

EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2
METRIC_KEYS = ("loss_sum", "weight_sum", "n_correct", "n_pred", "streak_sum", "n_blocks")


def _poison(loss: torch.Tensor) -> torch.Tensor:
    """DFLASH_FAULT's non-finite step: a NaN loss (and NaN gradients) for every piece."""
    return loss * float("nan")


class NonFiniteLoss(RuntimeError):
    """Too many consecutive non-finite losses: the run is diverging."""


class NonFiniteState(RuntimeError):
    """The drafter's parameters or optimizer state went non-finite: no checkpoint is written."""


# Failures the run explains in its ERROR line; a traceback would only bury it.
EXPLAINED = (NonFiniteLoss, NonFiniteState)


@dataclass(frozen=True)
class RunOptions:
    config: Path
    run_dir: Path
    resume: str = "auto"  # "auto" | "never" | a checkpoint path | a step number
    fresh: bool = False


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


class Run:
    """One training process (one data-parallel rank)."""

    def __init__(self, opts: RunOptions, cfg: TrainConfig, world: distributed.World) -> None:
        self.opts, self.cfg, self.world = opts, cfg, world
        self.run_dir = opts.run_dir
        self.reporter = Reporter(self.run_dir, enabled=world.is_main)
        self.sup = Supervisor()
        self.faults = FaultPlan()
        self.stop_request = threading.Event()
        self.signal_name: str | None = None
        # (name, monotonic time, whether the stop's checkpoint was already written) per signal
        self.signals: list[tuple[str, float, bool]] = []
        self.stop_done = False  # the stop is recorded: later signals are ignored
        self.state_file = RunStateFile(self.run_dir)
        self.saved_step = 0  # step of the newest checkpoint on disk (0: none yet)
        self.saved_path: Path | None = None  # that checkpoint (may be another run's, --resume)
        self.saving = False
        self.final_save_failed = False
        self.board = Board()
        self.t0 = time.monotonic()
        self.stopped_by_signal = False
        self._stop_announced = False
        self._announce_lock = threading.Lock()
        self.completed = False
        self.windows = {k: RateWindow(cfg.status.rate_window_s) for k in ("tgt", "dft", "tok")}
        self.tracker: Any = None  # trainer.tracking.MultiTracker on the main rank, once set up
        self._tracker_lock = threading.Lock()  # the monitor and the drafter both log
        self.last_tau: float | None = None  # the last evaluation's tau (status lines' tau=)

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg, world = self.cfg, self.world
        self.reporter.phase("loading")
        self.drafter_device, self.target_devices = distributed.pick_devices(cfg, world)
        if world.is_main:
            store_path = assets.ensure_store(cfg)
            target_dir = assets.ensure_target(cfg)
        distributed.barrier(world)
        store_path, target_dir = assets.ensure_store(cfg), assets.ensure_target(cfg)
        from trainer.buckets import PlanError, sampler_for
        from trainer.data.store import StoreError, TokenStore
        from trainer.sampler import SamplerError, holdout_rows

        try:
            self.store = TokenStore.open(store_path)
        except StoreError as exc:
            raise assets.UserError(f"data.store: {exc}") from None
        lengths = np.asarray(self.store.lengths, dtype=np.int64)
        try:  # the held-out rows: a pure function of (rows, count, seed), never trained on
            self.holdout = holdout_rows(len(lengths), cfg.eval.holdout_rows, cfg.seed)
        except SamplerError as exc:
            raise assets.UserError(f"eval.holdout_rows: {exc}") from None
        try:
            self.sampler = sampler_for(
                cfg.batching,
                lengths,
                seed=cfg.seed,
                rank=world.rank,
                world_size=world.size,
                exclude=self.holdout,
            )
        except (PlanError, SamplerError) as exc:
            raise assets.UserError(f"batching: {self.store.name_rows(str(exc))}") from None
        if len(self.holdout) and world.is_main:
            self._record_holdout()
        self.plan = BatchPlan(self.sampler, cfg.schedule.epochs)
        accum = cfg.optimizer.grad_accum
        self.total_steps = self.plan.total // accum
        if self.total_steps < 1:
            raise assets.UserError(
                f"schedule: {self.plan.total} micro-batches per rank cannot make one optimizer "
                f"step with optimizer.grad_accum={accum}"
            )
        self.end_step = min(self.total_steps, cfg.schedule.max_steps or self.total_steps)
        self.warmup = warmup_steps_for(
            self.total_steps, cfg.schedule.warmup_steps, cfg.schedule.warmup_ratio
        )

        self.target_dir = target_dir
        hf = assets.target_hf_config(target_dir)
        self.layer_ids = assets.layer_ids_for(cfg, hf)
        self.dcfg = assets.drafter_config(cfg, hf, self.layer_ids)
        self.target_dtype = self._target_dtype()
        borrowed = assets.load_borrowed(target_dir, hf, self.drafter_device, self.target_dtype)
        self.drafter = assets.build_drafter(
            self.dcfg,
            borrowed,
            self.drafter_device,
            cfg.seed,
            checkpoint_layers=cfg.model.drafter.checkpoint_layers,
        )
        self.params = [p for p in self.drafter.parameters() if p.requires_grad]
        o = cfg.optimizer
        self.opt = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + world.rank)
        self.start_step = 0
        self.best: tuple[int, float] | None = None  # (step, held-out tau) of the best checkpoint
        self._resume()
        self.evaluator = self._evaluator() if cfg.eval.enabled else None
        self.start_micro = self.start_step * accum
        self.end_micro = self.end_step * accum
        self.board.real_tokens = self.plan.real_tokens_before(self.start_micro)
        if world.is_main and cfg.tracking.backends:  # last: nothing after it can refuse the run
            from trainer.tracking import open_trackers

            self.tracker = open_trackers(
                cfg.tracking,
                self.run_dir,
                config=cfg.model_dump(mode="json"),
                resume_step=self.start_step or None,
                warn=self.reporter.warn,
            )

    # ------------------------------------------------------------------ trackers
    def track(self, line: str) -> None:
        """Log the figures of a printed status or Eval line, read back by the line parser (so
        the trackers hold exactly what the TUI shows). A tracker never stops training: each
        backend warns once and drops out (trainer.tracking); anything else is one warning here."""
        if self.tracker is None:
            return
        from trainer.tracking import log_event

        ev = parse_line(line)
        if not isinstance(ev, StatusEvent | EvalEvent):
            return

        with self._tracker_lock:
            if self.tracker is None:
                return
            try:
                log_event(self.tracker, ev)
            except Exception as exc:
                self.tracker = None
                self.reporter.warn(f"tracking: logging failed, trackers are off ({exc!r})")

    def close_trackers(self) -> None:
        """Every exit path (finished, stopped, failed): flush and close once."""
        with self._tracker_lock:
            tracker, self.tracker = self.tracker, None
        if tracker is not None:
            try:
                tracker.close()
            except Exception as exc:
                self.reporter.warn(f"tracking: close failed ({exc!r})")

    def _record_holdout(self) -> None:
        """The held-out rows in run-state.json (count, digest) and RUN/holdout.json (the ids)."""
        from trainer.sampler import rows_digest

        ev = self.cfg.eval
        self.record(holdout_rows=len(self.holdout), holdout_sha256=rows_digest(self.holdout))
        evaluated = min(ev.max_rows, len(self.holdout)) if ev.enabled else 0
        ids = {"seed": self.cfg.seed, "rows": self.holdout.tolist(), "evaluated": evaluated}
        try:
            _write_json(self.run_dir / "holdout.json", ids)
        except OSError as exc:  # the ids are a pure function of the config: training goes on
            self.reporter.error(f"cannot write {self.run_dir / 'holdout.json'}: {exc}")

    def _held_out_rows(self) -> tuple[Any, np.ndarray]:
        """(store, row ids) to evaluate: `[eval] holdout_store`'s first rows, or the first
        `max_rows` held-out rows of the training store."""
        from trainer.data.store import StoreError, TokenStore

        ev = self.cfg.eval
        if ev.holdout_store is None:
            return self.store, self.holdout[: ev.max_rows]
        path = self.cfg.resolve(ev.holdout_store)
        try:
            store = TokenStore.open(path)
        except StoreError as exc:
            raise assets.UserError(f"eval.holdout_store: {exc}") from None
        vocab = int(assets.target_hf_config(self.target_dir).vocab_size)
        if store.manifest.vocab_size > vocab or len(store) == 0:
            what = (
                "no rows"
                if len(store) == 0
                else (f"token ids up to {store.manifest.vocab_size - 1}, the target has {vocab}")
            )
            raise assets.UserError(f"eval.holdout_store: {path}: {what}")
        return store, np.arange(min(ev.max_rows, len(store)), dtype=np.int64)

    def _evaluator(self) -> InTraining:
        """The held-out rows' features, captured once by a target on the drafter's device
        (main rank only; the target is dropped afterwards), and the evaluation schedule."""
        cfg = self.cfg
        batches, real = None, None
        if self.world.is_main:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
            target = TargetModel.load(
                self.target_dir, self.layer_ids, self.drafter_device, self.target_dtype
            )
            store, rows = self._held_out_rows()
            batches = capture_held_out(
                store,
                rows,
                target,
                token_budget=cfg.batching.token_budget,
                max_batch=cfg.batching.max_batch,
            )
            real = self._real_tau(target) if cfg.eval.prompts is not None else None
            del target  # kept by `real` when prompts are decoded
            if self.drafter_device.type == "cuda":
                torch.cuda.empty_cache()
            self.record(
                eval_rows=len(rows),
                best_step=self.best[0] if self.best else None,
                best_tau=self.best[1] if self.best else None,
            )
        # An eval piece is never larger than the largest training packet can be.
        m = cfg.model
        budget = m.max_query_rows or cfg.batching.max_batch * m.num_anchors * self.dcfg.block_size
        return InTraining(
            cfg.eval, batches, gamma=m.gamma, max_query_rows=budget, best=self.best, real=real
        )

    def _real_tau(self, target: TargetModel) -> Callable[[Any], tuple[float, int, int]]:
        """Real greedy speculative decoding of `[eval] prompts` (trainer.eval's own loop and
        greedy check), read and rendered now so a bad file fails before training starts."""
        from trainer.eval import default_stop_ids, load_tokenizer, target_vocab_size
        from trainer.eval import evaluate as real_evaluate
        from trainer.eval_prompts import PromptError, Renderer, read_prompt_set
        from trainer.model.target import TargetError

        ev = self.cfg.eval
        assert ev.prompts is not None
        path = self.cfg.resolve(ev.prompts)
        try:
            pset = read_prompt_set(path)
            pset = dataclasses.replace(pset, prompts=pset.prompts[: ev.max_prompts])
            tokenizer = load_tokenizer(self.target_dir, required=pset.needs_tokenizer)
            renderer = Renderer(tokenizer, target_vocab_size(self.target_dir))
            for prompt in pset.prompts:
                renderer.first_ids(prompt, f"{path}:{prompt.line}")
            stops = default_stop_ids(tokenizer, self.target_dir)
        except (PromptError, TargetError) as exc:
            raise assets.UserError(f"eval.prompts: {exc}") from None

        def real(drafter: Any) -> tuple[float, int, int]:
            _, summaries = real_evaluate(
                target, drafter, [pset], renderer, max_new_tokens=ev.max_new_tokens, eos_id=stops
            )
            total = summaries[-1]
            return total.tau, total.matches, total.prompts

        return real

    def _target_dtype(self) -> torch.dtype:
        name = self.cfg.topology.target_dtype
        if name != "auto":
            return getattr(torch, name)
        return torch.bfloat16 if self.drafter_device.type == "cuda" else torch.float32

    def record(self, **fields: Any) -> None:
        """Update run-state.json (main rank); a corrupted file or a failed write is one line."""
        if not self.world.is_main:
            return
        for problem in self.state_file.update(**fields):
            self.reporter.error(problem)

    def _explicit_checkpoint(self, value: str) -> Path:
        """`--resume PATH` or `--resume STEP` (digits: step-STEP.pt in RUN/checkpoints)."""
        if not value.isdigit():
            return Path(value)
        path = checkpoint.checkpoint_path(self.run_dir, int(value))
        if not path.is_file():
            have = [s for s, _ in checkpoint.list_checkpoints(self.run_dir)]
            listed = ", ".join(map(str, have)) if have else "none"
            raise checkpoint.CheckpointError(
                path, f"no checkpoint for step {int(value)} (steps here: {listed})"
            )
        return path

    def _resume(self) -> None:
        opts = self.opts
        found = checkpoint.list_checkpoints(self.run_dir)
        if opts.fresh:
            if self.world.is_main and found:
                dest = checkpoint.archive_checkpoints(self.run_dir)
                self.reporter.line(f"Archived old checkpoints to {dest}", status_log=False)
            distributed.barrier(self.world)
            return
        if opts.resume == "never":
            if found:
                raise assets.UserError(
                    f"{checkpoint.checkpoint_dir(self.run_dir)}: holds checkpoints but "
                    "--resume never was given: pass --fresh to archive them and start over"
                )
            return
        skipped: list[checkpoint.Skipped] = []
        if opts.resume == "auto":
            if not found:
                return
            sel = checkpoint.select_resume(self.run_dir)
            skipped = list(sel.skipped)
            if sel.path is None or sel.state is None:
                why = "; ".join(f"{k.path.name}: {k.reason}" for k in skipped)
                raise assets.UserError(
                    f"{checkpoint.checkpoint_dir(self.run_dir)}: no usable checkpoint ({why}); "
                    "--resume PATH|STEP picks one, --fresh archives them and starts over"
                )
            path, state = sel.path, sel.state
        else:
            path = self._explicit_checkpoint(opts.resume)
            state = checkpoint.load_checkpoint(path)
            # Newer checkpoints here belong to the timeline being abandoned: an automatic
            # resume after a crash must not jump back to them.
            step = int(state["step"])
            skipped = [
                checkpoint.Skipped(p, f"newer than step {step}, resumed by --resume {opts.resume}")
                for s, p in found
                if s > step and p.resolve() != path.resolve()
            ]
        self._check_compatible(path, state)
        self._load_state(path, state)
        distributed.barrier(self.world)  # every rank has read its checkpoint before any moves
        for k in skipped:
            where = ""
            if self.world.is_main:
                try:
                    where = f"; moved to {checkpoint.reject_checkpoint(k.path, k.reason)}"
                except OSError as exc:
                    where = f"; could not move it aside: {exc.strerror or exc}"
            self.reporter.error(f"skipped checkpoint {k.path}: {k.reason}{where}")
        detail = f"step={self.start_step} path={path}"
        if skipped:
            detail += " skipped=" + ",".join(k.path.name for k in skipped)
        self.reporter.phase("resuming", detail)

    def _check_compatible(self, path: Path, state: dict[str, Any]) -> None:
        try:
            old = TrainConfig.from_dict(state["config"], source=f"{path} (saved config)")
        except ConfigError as exc:
            raise assets.UserError(str(exc)) from None
        changed = resume_critical_changes(old, self.cfg)
        if changed:
            raise assets.UserError(
                f"{self.opts.config}: cannot resume from {path}: changed {', '.join(changed)} "
                "(data order or model shape); use --fresh to archive the checkpoints and restart"
            )
        if state["world_size"] != self.world.size:
            raise assets.UserError(
                f"{path}: written by {state['world_size']} rank(s), this run has "
                f"{self.world.size}: the data order would change; use --fresh"
            )
        from trainer.sampler import SamplerError

        try:
            self.resume_seq = self.plan.load_state_dict(state["sampler"])
        except SamplerError as exc:
            raise assets.UserError(f"{path}: {exc}") from None

    def _load_state(self, path: Path, state: dict[str, Any]) -> None:
        self.drafter.load_state_dict(state["drafter"], strict=True)
        self.opt.load_state_dict(state["optimizer"])
        checkpoint.set_rng_state(self.gen, state["rng"][self.world.rank])
        self.start_step = self.saved_step = int(state["step"])
        self.saved_path = path
        self.board.nonfinite = int(state["counters"]["nonfinite"])
        best = (state.get("eval") or {}).get("best")
        if best is not None and checkpoint.checkpoint_path(self.run_dir, int(best[0])).is_file():
            self.best = (int(best[0]), float(best[1]))
        self.board.step = self.start_step
        self.board.micro = self.start_step * self.cfg.optimizer.grad_accum

    # ------------------------------------------------------------------ stages
    def start_stages(self) -> None:
        topo = self.cfg.topology
        nb = self.sampler.num_buckets
        self.q_pre: list[queue.Queue[HostBatch]] = [
            queue.Queue(maxsize=topo.prefetch_depth) for _ in range(nb)
        ]
        self.q_hs: ReorderBuffer[Packet] = ReorderBuffer(topo.hidden_depth, self.start_micro)
        pin = self.drafter_device.type == "cuda" or any(
            d.startswith("cuda") for d in self.target_devices
        )
        # One prefetch thread per bucket: a thread serving several buckets in sequence order
        # would block on one full queue while the others run dry (head-of-line blocking).
        self.pre_clocks = [WaitClock() for _ in range(nb)]
        for w in range(nb):
            body = prefetch_body(
                plan=self.plan,
                store=self.store,
                buckets=[w],
                queues=self.q_pre,
                start_seq=self.start_micro,
                end_seq=self.end_micro,
                stop=self.sup.stop,
                clock=self.pre_clocks[w],
                faults=self.faults,
                pin=pin,
            )
            self.sup.spawn(f"prefetch[{w}]", body)
        claims = Claims(self.start_micro, self.end_micro)
        self.tgt_done = Counter()
        self.tgt_clocks = [WaitClock() for _ in self.target_devices]
        for i, dev in enumerate(self.target_devices):

            def load(dev: str = dev) -> TargetModel:
                from transformers.utils import logging as hf_logging

                hf_logging.disable_progress_bar()  # bars would interleave with status lines
                return TargetModel.load(self.target_dir, self.layer_ids, dev, self.target_dtype)

            body = target_body(
                load_target=load,
                plan=self.plan,
                claims=claims,
                queues=self.q_pre,
                out=self.q_hs,
                drafter_device=self.drafter_device,
                stop=self.sup.stop,
                clock=self.tgt_clocks[i],
                done=self.tgt_done,
                faults=self.faults,
            )
            self.sup.spawn(f"target[{dev}#{i}]", body)
        self.dft_clock = WaitClock()
        self.drafter_thread = self.sup.spawn("drafter", self._drafter_loop)

    # ------------------------------------------------------------------ drafter step
    def _drafter_loop(self) -> None:
        cfg, world = self.cfg, self.world
        o, m = cfg.optimizer, cfg.model
        dev = self.drafter_device
        autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if dev.type == "cuda"
            else contextlib.nullcontext()
        )
        # Line-buffered: a full disk shows at the write (one line, training goes on), not at close.
        metrics_log = (
            open(self.run_dir / "metrics.jsonl", "a", buffering=1)  # noqa: SIM115
            if world.is_main
            else None
        )
        step, nonfinite_run = self.start_step, 0
        real_total = self.plan.real_tokens_before(self.start_micro)
        last_ckpt = time.monotonic()
        every_s = (cfg.checkpoint.every_minutes or math.inf) * 60
        ev = self.evaluator
        nb = self.sampler.num_buckets
        if ev is not None:
            ev.start()
            if step == 0:  # the untrained baseline (no checkpoint, so never the best)
                self._report_eval(0, ev.run(self.drafter, autocast))
        try:
            while step < self.end_step:
                # The RNGs at the step boundary: a second signal can abandon a step halfway
                # through its micro-batches and still checkpoint the last completed one.
                rng_at_step = checkpoint.rng_state(self.gen) if o.grad_accum > 1 else None
                lr = lr_at(
                    step,
                    total_steps=self.total_steps,
                    warmup_steps=self.warmup,
                    peak=o.lr,
                    floor=cfg.schedule.min_lr,
                )
                for group in self.opt.param_groups:
                    group["lr"] = math.inf if self.faults.inf_lr_at(step) else lr
                sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64, device=dev)
                bucket_sums = torch.zeros(2 * nb, dtype=torch.float64, device=dev)
                real = 0
                for _ in range(o.grad_accum):
                    try:
                        seq, pkt = self.q_hs.get(self.sup.stop, self.dft_clock)
                    except Stopped:
                        self._stop_at_once(step, rng_at_step)
                        raise
                    self.faults.tick("drafter")
                    # forward+backward in pieces of <= m.max_query_rows query rows (None: one)
                    res = bounded_objective_backward(
                        self.drafter,
                        pkt.input_ids,
                        pkt.loss_mask,
                        pkt.attention_mask,
                        pkt.hidden,
                        max_query_rows=m.max_query_rows,
                        num_anchors=m.num_anchors,
                        gamma=m.gamma,
                        noise=m.noise,
                        generator=self.gen,
                        autocast=autocast,
                        loss_transform=_poison if self.faults.nonfinite_at(step) else None,
                    )
                    sums += torch.stack(
                        [getattr(res, k).detach().to(torch.float64) for k in METRIC_KEYS]
                    )
                    if nb > 1:  # this rank's batch of seq comes from one length bucket
                        i = 2 * self.plan.batch(seq).bucket
                        pair = torch.stack([res.loss_sum.detach(), res.weight_sum.detach()])
                        bucket_sums[i : i + 2] += pair.to(torch.float64)
                    real += pkt.real_tokens
                flags = [
                    float(self.stop_request.is_set()),
                    float(time.monotonic() - last_ckpt >= every_s),
                    float(ev is not None and ev.time_due()),
                ]
                nf = len(flags)
                tail = torch.tensor([*flags, self.q_hs.depth()], dtype=torch.float64, device=dev)
                depth_slots = torch.zeros(world.size, dtype=torch.float64, device=dev)
                depth_slots[world.rank] = tail[nf]
                red = distributed.all_reduce_sum(
                    torch.cat([sums, tail[:nf], depth_slots, bucket_sums]), world
                )
                vals = red.tolist()  # the one host sync per optimizer step
                loss_sum, weight = vals[0], vals[1]
                gnorm: float | None = None
                if not math.isfinite(loss_sum):
                    nonfinite_run += 1
                    self.board.nonfinite += 1
                    if nonfinite_run >= o.max_nonfinite:
                        raise NonFiniteLoss(
                            f"{nonfinite_run} non-finite losses in a row (step {step + 1}): the run "
                            "diverged; lower optimizer.lr or check the data"
                        )
                elif weight > 0:
                    nonfinite_run = 0
                    distributed.reduce_gradients(self.params, world, 1.0 / weight)
                    max_norm = o.clip if o.clip > 0 else math.inf
                    gnorm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
                    self.opt.step()
                self.opt.zero_grad(set_to_none=True)
                step += 1
                micro = step * o.grad_accum
                real_total = self.plan.real_tokens_before(micro)
                at = len(METRIC_KEYS) + nf
                self.board.q_hs = [int(x) for x in vals[at : at + world.size]]
                at += world.size
                per_bucket = [(vals[at + 2 * j], vals[at + 2 * j + 1]) for j in range(nb)]
                self.board.add_step(
                    step,
                    micro,
                    real_total,
                    lr,
                    gnorm,
                    dict(zip(METRIC_KEYS, vals, strict=False)),
                    per_bucket if nb > 1 and math.isfinite(loss_sum) else None,
                )
                if metrics_log is not None:
                    loss = loss_sum / weight if weight > 0 else None
                    rec = {"step": step, "loss": loss, "lr": lr, "gnorm": gnorm, "micro": micro}
                    self.reporter.append(metrics_log, json.dumps(rec) + "\n")
                stop_now = vals[len(METRIC_KEYS)] > 0
                due = vals[len(METRIC_KEYS) + 1] > 0
                every = cfg.checkpoint.every_steps
                if stop_now:
                    self.announce_stop()  # before its checkpoint line, even if the monitor is asleep
                final = stop_now or step == self.end_step
                # Between steps, never on a signalled stop (that must end quickly): an eval
                # draws no random numbers, so the next step is what it would have been.
                res: EvalResult | None = None
                new_best, prev_best = False, self.best
                if ev is not None and not stop_now:
                    eval_time = vals[len(METRIC_KEYS) + 2] > 0
                    if ev.due(step, eval_time, step == self.end_step):
                        res = ev.run(self.drafter, autocast)
                        better = torch.tensor(
                            [float(ev.better(step, res))], dtype=torch.float64, device=dev
                        )
                        new_best = distributed.all_reduce_sum(better, world).item() > 0
                        if new_best and res is not None and res.tau is not None:
                            self.best = ev.best = (step, res.tau)  # saved with this checkpoint
                if final or due or (every and step % every == 0) or new_best:
                    saved = self._save(step)
                    last_ckpt = time.monotonic()
                    if new_best:
                        self._mark_best(step, saved, prev_best)
                    if res is not None:
                        self._report_eval(step, res)
                    if final and not saved:
                        self.final_save_failed = True
                        return
                elif res is not None:
                    self._report_eval(step, res)
                if stop_now:
                    self.stopped_by_signal = True
                    return
            self.completed = True
        finally:
            if metrics_log is not None:
                with contextlib.suppress(OSError):
                    metrics_log.close()

    def _stop_at_once(self, step: int, rng: dict[str, Any] | None) -> None:
        """The drafter was told to stop while waiting for data (a second signal): checkpoint
        the last completed step unless it is on disk already (one rank only: the others may
        not be at the same boundary, and the save's gather would hang)."""
        if not self.stop_request.is_set() or self.sup.failure is not None:
            return  # a failure elsewhere, not a signal: the run reports that
        self.stopped_by_signal = True
        self.announce_stop()  # before the checkpoint line, as for a first-signal stop
        if step > self.saved_step and self.world.size == 1 and not self._save(step, rng):
            self.final_save_failed = True

    def _save(self, step: int, rng_snapshot: dict[str, Any] | None = None) -> bool:
        """Write the checkpoint of `step`; False (after one ERROR line) if it was not written."""
        rng = distributed.gather_objects(rng_snapshot or checkpoint.rng_state(self.gen), self.world)
        if not self.world.is_main:
            return True
        micro = step * self.cfg.optimizer.grad_accum
        state = {
            "step": step,
            "micro": micro,
            "world_size": self.world.size,
            "config": self.cfg.model_dump(mode="json"),
            "config_hash": config_hash(self.cfg),
            "drafter_config": self.dcfg.model_dump(mode="json"),
            "drafter": self.drafter.state_dict(),
            "optimizer": self.opt.state_dict(),
            "schedule": {"total_steps": self.total_steps, "warmup_steps": self.warmup},
            "sampler": self.plan.state_dict(micro),
            "rng": rng,
            "counters": {"nonfinite": self.board.nonfinite},
            "eval": {"holdout_rows": len(self.holdout), "best": self.best},
        }
        self.saving = True
        try:
            path = checkpoint.save_checkpoint(
                self.run_dir,
                step,
                state,
                self.cfg.checkpoint.keep_last,
                keep_every_steps=self.cfg.checkpoint.keep_every_steps,
                protect={self.best[0]} if self.best else set(),
            )
        except checkpoint.CheckpointWriteError as exc:
            if checkpoint.nonfinite_entries(state):
                # The weights themselves diverged: every later step is NaN too, so stop here
                # with the good checkpoints intact rather than train on garbage.
                raise NonFiniteState(
                    f"step {step}: {exc}; the run diverged: lower optimizer.lr and resume"
                ) from None
            self.reporter.error(str(exc))
            self.record(checkpoint_error=str(exc))
            return False
        finally:
            self.saving = False
        self.saved_step, self.saved_path = step, path
        self.reporter.checkpoint(step, path)
        self.record(last_step=step, last_checkpoint=str(path), checkpoint_error=None)
        return True

    def _mark_best(self, step: int, saved: bool, prev: tuple[int, float] | None) -> None:
        """Point `checkpoints/best.pt` at the new best's checkpoint (if it was written)."""
        if not saved:
            self.best = prev  # no checkpoint of this step: the best stays where it was
            if self.evaluator is not None:
                self.evaluator.best = prev
            return
        if not self.world.is_main or self.best is None:
            return
        try:
            link = checkpoint.set_best(self.run_dir, step)
        except (OSError, checkpoint.CheckpointError) as exc:
            self.reporter.error(f"cannot mark step {step} as the best checkpoint: {exc}")
            return
        self.record(best_step=step, best_tau=self.best[1], best_checkpoint=str(link.resolve()))

    def _report_eval(self, step: int, res: EvalResult | None) -> None:
        """The Eval line (main rank) and its figures in run-state.json."""
        if res is None or self.evaluator is None:
            return
        ev = self.evaluator.event(step, res)
        if ev.tau is not None:
            self.last_tau = ev.tau  # status lines carry it from now on
        line = format_eval_line(ev)
        self.reporter.line(line)
        self.track(line)
        if res.greedy_match is not None and res.greedy_match[0] < res.greedy_match[1]:
            same, n = res.greedy_match
            self.reporter.error(
                f"eval.prompts: {n - same} of {n} speculative outputs differ from greedy "
                f"decoding at step {step} (a decoding bug: tau_real is not trustworthy)"
            )
        share = self.evaluator.share()
        self.record(
            last_eval=ev.model_dump(mode="json", exclude={"kind", "extra"}),
            eval_seconds=round(self.evaluator.spent, 3),
            eval_share=round(share, 4) if share is not None else None,
        )

    # ------------------------------------------------------------------ monitor
    def monitor(self) -> None:
        st = self.cfg.status
        windows = self.windows
        since: dict[tuple[int, str], float] = {}
        last_t = time.monotonic()
        next_t = last_t
        first = True
        while self.drafter_thread.is_alive() and not self.sup.stop.is_set():
            if self.stop_request.is_set():
                self.announce_stop()
            now = time.monotonic()
            if now < next_t:
                self.drafter_thread.join(min(0.1, next_t - now))
                continue
            self.faults.tick("monitor")
            dt = now - last_t
            waits = None
            if not first:
                waits = {
                    "w_pre_out": wait_percent(self.pre_clocks, "output_s", since, dt),
                    "w_tgt_in": wait_percent(self.tgt_clocks, "input_s", since, dt),
                    "w_tgt_out": wait_percent(self.tgt_clocks, "output_s", since, dt),
                    "w_dft_in": wait_percent([self.dft_clock], "input_s", since, dt),
                }
            else:
                for clocks, attr in (
                    (self.pre_clocks, "output_s"),
                    (self.tgt_clocks, "input_s"),
                    (self.tgt_clocks, "output_s"),
                    ([self.dft_clock], "input_s"),
                ):
                    wait_percent(clocks, attr, since, 1.0)  # baseline the clocks
            self.emit_status(now, windows, waits)
            if not first and self.world.is_main:  # a corrupted run-state heals within a line
                for problem in self.state_file.heal():
                    self.reporter.error(problem)
            first, last_t = False, now
            next_t += st.interval_s
            if next_t < now:
                next_t = now + st.interval_s

    def emit_status(
        self, now: float, windows: dict[str, RateWindow], waits: dict[str, float] | None
    ) -> None:
        b = self.board
        tgt = windows["tgt"].add(now, self.tgt_done.value)
        dft = windows["dft"].add(now, b.micro)
        tok = windows["tok"].add(now, b.real_tokens if b.real_tokens else 0)
        ktok = tok / 1000 if tok is not None else None
        remaining = self.plan.real_tokens_before(self.end_micro) - self.plan.real_tokens_before(
            b.micro
        )
        eta = remaining / tok if tok and tok > 0 else None
        # One rank sees its own buffer live; the others' depths come with each step's reduce.
        q_hs = [self.q_hs.depth()] if self.world.size == 1 or not b.q_hs else b.q_hs
        nb = self.sampler.num_buckets  # loss_b only when batches come from several buckets
        line = status_line(
            elapsed_s=now - self.t0,
            board=b,
            metrics=b.take_metrics(),
            noise=self.cfg.model.noise,
            tgt_bps=tgt,
            dft_bps=dft,
            ktok_s=ktok,
            q_pre=[q.qsize() for q in self.q_pre],
            q_hs=q_hs,
            epoch=self.plan.epoch_progress(b.micro),
            eta_s=eta,
            waits=waits,
            tau=self.last_tau,
            bucket_losses=b.take_bucket_losses(nb) if nb > 1 else None,
        )
        self.reporter.line(line)
        self.track(line)

    # ------------------------------------------------------------------ signals
    def announce_stop(self) -> None:
        """Print the stopping line once, from whichever thread sees the request first.

        The monitor polls every 0.1 s; the drafter can finish its step and checkpoint before
        that, so it announces too, and the line always precedes the stop's checkpoint line.
        """
        with self._announce_lock:
            if self._stop_announced:
                return
            self._stop_announced = True
        self.reporter.phase("stopping", f"({self.signal_name})")

    def install_signals(self) -> None:
        def handler(signum: int, _frame: Any) -> None:
            # Only flags here: the main thread may hold the reporter's lock.
            if self.stop_done:
                return
            late = self.stopped_by_signal  # the first stop already checkpointed and returned
            self.signals.append((signal.Signals(signum).name, time.monotonic(), late))
            if self.stop_request.is_set():
                if not late:
                    self.sup.stop.set()  # second signal: stop now (see _stop_at_once)
                return
            self.signal_name = signal.Signals(signum).name
            self.stop_request.set()  # the drafter checkpoints after its current step

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, handler)
            signal.signal(signal.SIGTERM, handler)

    def ignore_signals(self) -> None:
        """The outcome is recorded: a late Ctrl-C must not kill the exiting process (exit 130)."""
        self.stop_done = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def saved_name(self) -> str:
        return self.saved_path.name if self.saved_path else "no checkpoint"

    def stop_detail(self) -> str | None:
        """One line on how a signalled stop ended, for run-state.json (None: no signal)."""
        if not self.signals:
            return None
        first, t0, _ = self.signals[0]
        step, saved, name = self.board.step, self.saved_step, self.saved_name()
        if saved >= step:
            kept = f"checkpoint {name} holds step {step}"
        elif saved:
            kept = f"steps {saved + 1}-{step} lost: last checkpoint {name}"
        else:
            kept = f"steps 1-{step} lost: no checkpoint"
        if len(self.signals) == 1:
            return f"{first}: finished step {step} and stopped; {kept}"
        name, t1, late = self.signals[1]
        more = f" (+{len(self.signals) - 2} more)" if len(self.signals) > 2 else ""
        if late:
            return (
                f"{first}: finished step {step} and stopped; {kept}; {name} {t1 - t0:.1f} s "
                f"later{more} came after that checkpoint and changed nothing"
            )
        return (
            f"second signal {name} {t1 - t0:.1f} s after {first}{more}: stopped at once after "
            f"step {step}; {kept}"
        )


def _write_json(path: Path, obj: Any) -> None:
    """Write JSON through a temp file and a rename (a crash leaves the old file or none)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def run(opts: RunOptions) -> int:
    """The CLI's body: returns the process exit status."""
    try:
        cfg = TrainConfig.load(opts.config)
    except ConfigError as exc:
        print(f"ERROR: {exc}", flush=True)
        return EXIT_USAGE
    opts.run_dir.mkdir(parents=True, exist_ok=True)
    world = distributed.init_world(torch.device(cfg.topology.drafter_devices[0]).type)
    r = Run(opts, cfg, world)
    newest = checkpoint.list_checkpoints(opts.run_dir)[-1:]
    # Every field the trainer owns, written whole (a corrupted file is replaced, not merged).
    r.record(
        pid=os.getpid(),
        config_hash=config_hash(cfg),
        release=_release(),
        started_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        state="starting",
        exit_status=None,
        world_size=world.size,
        last_step=newest[0][0] if newest else None,
        last_checkpoint=str(newest[0][1]) if newest else None,
        checkpoint_error=None,
        stop_signal=None,
        signals=0,
        stop_detail=None,
        lost_steps=0,
        last_error=None,
    )
    r.install_signals()
    status = EXIT_FAILED
    try:
        status = _run(r)
        return status
    finally:
        if r.stopped_by_signal and status == EXIT_OK:
            state = "stopped"
        elif status == EXIT_OK:
            state = "finished"
        elif status == EXIT_USAGE:
            state = "refused"
        elif r.signals and r.sup.failure is None:
            state = "stopped"  # a signalled stop that could not keep every step (see detail)
        else:
            state = "crashed"
        r.record(
            state=state,
            exit_status=status,
            stop_signal=r.signals[0][0] if r.signals else None,
            signals=len(r.signals),
            stop_detail=r.stop_detail(),
            lost_steps=max(0, r.board.step - r.saved_step),
            last_error=r.reporter.last_error,
        )
        r.ignore_signals()
        r.close_trackers()  # finished, stopped or failed: after the last status line
        r.reporter.close()
        distributed.close_world(world)


def _run(r: Run) -> int:
    try:
        r.setup()
    except (assets.UserError, checkpoint.CheckpointError) as exc:
        r.reporter.error(str(exc))
        return EXIT_USAGE
    r.reporter.phase("starting")
    r.start_stages()
    r.record(
        state="running",
        last_step=r.start_step,
        last_checkpoint=str(r.saved_path) if r.saved_path else None,
        total_steps=r.total_steps,
        end_step=r.end_step,
        warmup_steps=r.warmup,
        boundaries=list(r.sampler.boundaries) if r.sampler.num_buckets > 1 else None,
    )
    r.reporter.phase("running")
    try:
        r.monitor()
    except Stopped:
        pass
    except BaseException as exc:
        r.sup.fail("monitor", exc)
    if r.stop_request.is_set():
        r.announce_stop()  # both signals may land within one monitor poll
    if len(r.signals) > 1 and not r.signals[1][2]:
        name = r.signals[1][0]
        r.reporter.phase("stopping", f"second {name}: stopping at once, no more steps")
    # A stop waits 5 s for the drafter, but does not interrupt a checkpoint being written
    # unless a third signal insists (a hung filesystem).
    deadline = time.monotonic() + 5
    while r.drafter_thread.is_alive():
        r.drafter_thread.join(0.1)
        insist = len(r.signals) > 2 or not r.saving
        if r.sup.stop.is_set() and insist and time.monotonic() > deadline:
            break
    r.sup.stop.set()
    stuck = r.sup.join(timeout=5.0)
    if r.sup.failure is not None:
        stage, exc, tb = r.sup.failure
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
        explained = isinstance(exc, EXPLAINED)
        r.reporter.error(
            f"stage {stage} failed: {type(exc).__name__}: {first}", None if explained else tb
        )
        return EXIT_FAILED
    if stuck:
        r.reporter.error(f"stages did not stop within 5 s: {', '.join(stuck)}")
    if r.final_save_failed:
        lost = r.board.step - r.saved_step
        start = f"resuming from {r.saved_name()}" if r.saved_path else "starting over"
        r.reporter.error(
            f"stopped at step {r.board.step} without its checkpoint: {start} repeats {lost} step(s)"
        )
        return EXIT_FAILED
    if r.stopped_by_signal and r.saved_step >= r.board.step:
        r.reporter.phase("stopping", f"done at step {r.board.step} ({r.signal_name})")
        return EXIT_OK
    if r.signals and not r.completed:
        r.reporter.error(f"stopped by {r.signal_name}: {r.stop_detail()}")
        return EXIT_FAILED
    if not r.completed:
        r.reporter.error("pipeline stopped before the end of the plan")
        return EXIT_FAILED
    r.emit_status(time.monotonic(), r.windows, None)
    if r.world.is_main and r.end_step == r.total_steps:
        from trainer.model.export import export_drafter

        out = export_drafter(r.drafter, r.run_dir / "export")
        r.reporter.line(f"Exported drafter to {out}", status_log=False)
        best = checkpoint.best_checkpoint(r.run_dir)
        if best is not None:  # the held-out best, alongside the last
            r.drafter.load_state_dict(checkpoint.load_checkpoint(best[1])["drafter"])
            out = export_drafter(r.drafter, r.run_dir / "export-best")
            r.reporter.line(f"Exported best drafter (step {best[0]}) to {out}", status_log=False)
    r.reporter.phase("finished", f"step={r.board.step}")
    return EXIT_OK
