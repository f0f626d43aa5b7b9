"""The run's checkpoints: when one is due, one written from the parts' `state_dict()`s, and one
loaded back into them (file format, atomic writes and retention: `trainer.pipeline.checkpoint`).

Writes are off the drafter's hot path: the drafter thread checks the state is finite, copies it
into host memory (`HostCopy`: pinned buffers when the parts live on CUDA, reused from one
checkpoint to the next) and hands the copy to a background thread (`BackgroundWrite`) that
writes it atomically as before; the drafter goes on training meanwhile. At most one write is in
flight: a checkpoint due while the previous one is still being written waits for it (one
WARNING line says how long). A final or stop checkpoint, and a new best (its `best.pt` link
needs the file), wait for their own write; the drafter's loop drains the writer before it ends.

A write that fails is one ERROR line naming the step, RUN/checkpoints and why (`CheckpointFailed`,
also in run-state.json with the count of failures in a row); training goes on, so a disk that
is freed in time loses nothing. `failing` says when `MAX_FAILED_IN_A_ROW` failed in a row: the
drafter's loop then stops the run (`runner.train`) rather than train what cannot be kept.
"""

from __future__ import annotations

import copy
import math
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from trainer.config import config_hash
from trainer.pipeline import checkpoint, distributed
from trainer.pipeline.build import Parts
from trainer.pipeline.evaluate import Best
from trainer.pipeline.status import Board, Reporter, RunRecord

RngState = dict[str, object]

MAX_FAILED_IN_A_ROW = 2
"""Failed checkpoint writes in a row after which the run stops (after one last try): two
checkpoint intervals of training that no checkpoint holds."""


class NonFiniteState(RuntimeError):
    """The drafter's parameters or optimizer state went non-finite: no checkpoint is written."""


class HostCopy:
    """A state tree copied off the live parts into host memory. Tensors on CUDA go to pinned
    buffers without blocking (the writer waits on `event` before reading them); CPU tensors
    are copied at once. Buffers are kept for the next copy, which may reuse them only once the
    write reading them has finished (the caller waits for it first)."""

    def __init__(self) -> None:
        self._buffers: dict[str, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None  # set when the last copy queued CUDA work

    def copy(self, tree: Any) -> Any:
        self.event = None
        out = self._walk(tree, "")
        if self.event is not None:
            self.event.record()
        return out

    def _walk(self, x: Any, path: str) -> Any:
        if isinstance(x, torch.Tensor):
            return self._tensor(x, path)
        if isinstance(x, dict):
            out = copy.copy(x)  # keeps the type and attributes (a state_dict's _metadata)
            for k, v in x.items():
                out[k] = self._walk(v, f"{path}/{k}")
            return out
        if isinstance(x, list | tuple):
            items = [self._walk(v, f"{path}/{i}") for i, v in enumerate(x)]
            return items if isinstance(x, list) else tuple(items)
        return x

    def _tensor(self, t: torch.Tensor, path: str) -> torch.Tensor:
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            self._buffers[path] = buf
        buf.copy_(t.detach(), non_blocking=t.is_cuda)
        if t.is_cuda and self.event is None:
            self.event = torch.cuda.Event()  # type: ignore[no-untyped-call]  # unannotated in torch
        return buf


class BackgroundWrite:
    """At most one checkpoint write in flight, on its own thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None  # not a write error (those are reported)
        self.ok = True  # the last write finished and its file is in place

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, write: Callable[[], bool]) -> None:
        def body() -> None:
            try:
                self.ok = write()
            except BaseException as exc:  # re-raised on the drafter thread by `wait`
                self.ok = False
                self._error = exc

        self._thread = threading.Thread(target=body, name="checkpoint-writer")
        self._thread.start()

    def wait(self) -> float:
        """Block until the write in flight (if any) has finished; the seconds waited. An
        unexpected exception in the writer is raised here."""
        t0 = time.monotonic()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc
        return time.monotonic() - t0


class Checkpointer:
    """Checkpoints of one run: `due`, `save`, `load`; it knows the newest one on disk."""

    def __init__(
        self, p: Parts, board: Board, best: Best, reporter: Reporter, record: RunRecord
    ) -> None:
        self.p, self.board, self.best = p, board, best
        self.reporter, self.record = reporter, record
        self.saved_step = 0  # step of the newest checkpoint on disk (0: none yet)
        self.saved_path: Path | None = None  # that checkpoint (may be another run's, --resume)
        self.every_s = (p.cfg.checkpoint.every_minutes or math.inf) * 60
        self.last_t = time.monotonic()
        self.host = HostCopy()
        self.writer = BackgroundWrite()
        self.blocked_s: list[float] = []  # per save: time the drafter thread spent in it
        self.failures = 0  # writes failed in a row (the writer thread's count)

    @property
    def failing(self) -> bool:
        """`MAX_FAILED_IN_A_ROW` writes in a row failed: the run must stop."""
        return self.failures >= MAX_FAILED_IN_A_ROW

    @property
    def saving(self) -> bool:
        """A write is in progress (a stop does not interrupt it)."""
        return self.writer.busy

    @property
    def saved_name(self) -> str:
        return self.saved_path.name if self.saved_path else "no checkpoint"

    def start_clock(self) -> None:
        self.last_t = time.monotonic()

    def time_due(self) -> bool:
        """`checkpoint.every_minutes` have passed since the last save (this rank's clock)."""
        return time.monotonic() - self.last_t >= self.every_s

    def due(self, step: int, *, final: bool, time_due: bool, new_best: bool) -> bool:
        every = self.p.cfg.checkpoint.every_steps
        return final or time_due or bool(every and step % every == 0) or new_best

    def state_dict(self, step: int, rng: list[RngState]) -> dict[str, object]:
        """The checkpoint of `step`: each part's own state, and what it is valid for."""
        p = self.p
        micro = step * p.accum
        return {
            "step": step,
            "micro": micro,
            "world_size": p.world.size,
            "topology": {"world_size": p.world.size, "local_world_size": p.world.local_size},
            "config": p.cfg.model_dump(mode="json"),
            "config_hash": config_hash(p.cfg),
            "loss": p.cfg.model.loss.label(),  # which loss ran (the config's [model.loss])
            "drafter_config": p.dcfg.model_dump(mode="json"),
            "drafter": p.drafter.state_dict(),
            "optimizer": p.opt.state_dict(),
            "schedule": p.schedule.state_dict(),
            "sampler": p.plan.state_dict(micro),
            "rng": rng,
            "counters": self.board.state_dict(),
            "eval": self.best.state_dict(len(p.holdout)),
        }

    def save(self, step: int, rng: RngState | None = None, *, wait: bool = True) -> bool:
        """Checkpoint `step` (`rng`: the RNGs at its start, else now). Every rank calls it (the
        RNGs are gathered); rank 0 writes in the background. With `wait` (the default), returns
        whether the file is in place (False after one ERROR line), on every rank (one small
        all-reduce); `wait=False` (the drafter's periodic saves) returns True once the write
        started, and the other ranks count it as saved (rank 0 is the run's truth)."""
        p = self.p
        ranks = distributed.gather_objects(rng or checkpoint.rng_state(p.gen), p.world)
        t0 = time.monotonic()
        try:
            self.record.progress(step)
            ok = True
            if p.world.is_main:
                self._submit(step, ranks, t0)
                if wait:
                    self.writer.wait()
                    ok = self.writer.ok
            if wait and p.world.distributed:
                # every rank waits for rank 0's file and learns whether it is in place (the
                # same decision everywhere: `wait` follows the step's all-reduced flags)
                failed = torch.tensor([0.0 if ok else 1.0], dtype=torch.float64)
                failed = distributed.all_reduce_sum(failed.to(p.drafter_device), p.world)
                ok = failed.item() == 0
            if ok and not p.world.is_main:
                self.saved_step = step
            return ok
        finally:
            self.last_t = time.monotonic()

    def _submit(self, step: int, ranks: list[RngState], t0: float) -> None:
        prev = self.saved_step
        busy = self.writer.busy
        waited = self.writer.wait()  # also raises what an earlier write hit unexpectedly
        if busy:
            self.reporter.warn(
                f"checkpoint of step {step} waited {waited:.1f} s for the previous write "
                f"(after step {prev}): writes take longer than the checkpoint interval"
            )
        state = self.state_dict(step, ranks)
        bad = checkpoint.nonfinite_entries(state)
        if bad:
            # The weights themselves diverged: every later step is NaN too, so stop here
            # with the good checkpoints intact rather than train on garbage.
            why = checkpoint.nonfinite_message(self.p.run_dir, step, bad)
            raise NonFiniteState(
                f"step {step}: {why}; the run diverged: lower optimizer.lr and resume"
            )
        snap = self.host.copy(state)
        event = self.host.event
        protect = {self.best.value[0]} if self.best.value else set()
        self.writer.start(lambda: self._write(step, snap, protect, event))
        self.blocked_s.append(time.monotonic() - t0)

    def _write(
        self,
        step: int,
        state: dict[str, Any],
        protect: set[int],
        event: torch.cuda.Event | None,
    ) -> bool:
        """The writer thread's part: the host copy to disk, atomically (then retention)."""
        if event is not None:
            event.synchronize()  # the copies the drafter queued have landed
        cfg = self.p.cfg.checkpoint
        try:
            path = checkpoint.save_checkpoint(
                self.p.run_dir,
                step,
                state,
                cfg.keep_last,
                keep_every_steps=cfg.keep_every_steps,
                protect=protect,
                before_sync=lambda: self.p.faults.tick("checkpoint"),
            )
        except checkpoint.CheckpointWriteError as exc:
            self.failures += 1
            self.reporter.error(str(exc))  # parses back as an ErrorEvent with checkpoint_failed
            self.record(
                checkpoint_error=str(exc),
                checkpoint_failed=exc.failed.model_dump(),
                checkpoint_failures=self.failures,
            )
            return False
        self.failures = 0
        self.saved_step, self.saved_path = step, path
        self.reporter.checkpoint(step, path)
        self.record(
            last_step=step,
            last_checkpoint=str(path),
            checkpoint_error=None,
            checkpoint_failed=None,
            checkpoint_failures=0,
        )
        return True

    def drain(self) -> None:
        """Wait for the write in flight (a stop or the end of training waits for it); an
        unexpected writer failure not raised yet is reported here."""
        try:
            self.writer.wait()
        except BaseException:
            tb = traceback.format_exc()
            self.reporter.error(f"checkpoint writer failed: {tb.strip().splitlines()[-1]}", tb)

    def load(self, path: Path, state: dict[str, Any], seq: int) -> int:
        """Load a checked checkpoint (`resume.check_compatible`) into the parts; its step."""
        p, board = self.p, self.board
        p.drafter.load_state_dict(state["drafter"], strict=True)
        p.opt.load_state_dict(state["optimizer"])
        checkpoint.set_rng_state(p.gen, state["rng"][p.world.rank])
        step = int(state["step"])
        self.saved_step, self.saved_path = step, path
        board.load_state_dict(state["counters"])
        self.best.load_state_dict(
            state.get("eval"), lambda s: checkpoint.checkpoint_path(p.run_dir, s).is_file()
        )
        board.step, board.micro = step, seq
        return step
