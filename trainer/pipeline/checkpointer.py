"""The run's checkpoints: when one is due, one written from the parts' `state_dict()`s, and one
loaded back into them (file format, atomic writes and retention: `trainer.pipeline.checkpoint`).
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from trainer.config import config_hash
from trainer.pipeline import checkpoint, distributed
from trainer.pipeline.build import Parts
from trainer.pipeline.evaluate import Best
from trainer.pipeline.status import Board, Reporter, RunRecord

RngState = dict[str, object]


class NonFiniteState(RuntimeError):
    """The drafter's parameters or optimizer state went non-finite: no checkpoint is written."""


class Checkpointer:
    """Checkpoints of one run: `due`, `save`, `load`; it knows the newest one on disk."""

    def __init__(
        self, p: Parts, board: Board, best: Best, reporter: Reporter, record: RunRecord
    ) -> None:
        self.p, self.board, self.best = p, board, best
        self.reporter, self.record = reporter, record
        self.saved_step = 0  # step of the newest checkpoint on disk (0: none yet)
        self.saved_path: Path | None = None  # that checkpoint (may be another run's, --resume)
        self.saving = False  # a write is in progress (a stop does not interrupt it)
        self.every_s = (p.cfg.checkpoint.every_minutes or math.inf) * 60
        self.last_t = time.monotonic()

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
            "config": p.cfg.model_dump(mode="json"),
            "config_hash": config_hash(p.cfg),
            "drafter_config": p.dcfg.model_dump(mode="json"),
            "drafter": p.drafter.state_dict(),
            "optimizer": p.opt.state_dict(),
            "schedule": p.schedule.state_dict(),
            "sampler": p.plan.state_dict(micro),
            "rng": rng,
            "counters": self.board.state_dict(),
            "eval": self.best.state_dict(len(p.holdout)),
        }

    def save(self, step: int, rng: RngState | None = None) -> bool:
        """Write the checkpoint of `step` (`rng`: the RNGs at its start, else now); False, after
        one ERROR line, when it was not written. Every rank calls it (the RNGs are gathered)."""
        p = self.p
        ranks = distributed.gather_objects(rng or checkpoint.rng_state(p.gen), p.world)
        try:
            return self._write(step, ranks) if p.world.is_main else True
        finally:
            self.last_t = time.monotonic()

    def _write(self, step: int, rng: list[RngState]) -> bool:
        cfg, state = self.p.cfg.checkpoint, self.state_dict(step, rng)
        self.saving = True
        try:
            path = checkpoint.save_checkpoint(
                self.p.run_dir,
                step,
                state,
                cfg.keep_last,
                keep_every_steps=cfg.keep_every_steps,
                protect={self.best.value[0]} if self.best.value else set(),
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
