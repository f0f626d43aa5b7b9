"""Free space for the checkpoints against what retention will hold on disk (torch-free).

A checkpoint is taken to be as large as the newest complete `checkpoints/step-*.pt` (0 before
the first: nothing to compare against yet). Retention comes from the run's config (the trainer
argv's `--config`, read with `trainer.config`, torch-free): at the peak of a checkpoint write the
disk holds `checkpoint.keep_last` checkpoints, the best one when the run evaluates (it may be
older than those), and the one being written, the rule deploy's preflight applies before the
run. What counts toward those slots and is already on disk is subtracted, so a run whose
retention is full needs room for one more, and one that has just begun needs room for the rest.
`keep_every_steps` keeps more on top (said, not counted, as in preflight). Without a readable
config the retention is unknown and one checkpoint is counted.

A statvfs, a directory listing and a cached config read: cheap enough for every few seconds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError, TrainConfig

MIB = 1024 * 1024
_NAME = re.compile(r"step-(\d{8,})\.pt")  # trainer.pipeline.checkpoint's complete-file name
BEST = "best.pt"  # trainer.pipeline.checkpoint.BEST: a relative symlink to a step file


@dataclass(frozen=True)
class Retention:
    """What the run's config keeps; `source` None: unknown (no readable config)."""

    keep_last: int = 1
    evaluates: bool = False  # [eval] every_steps/every_minutes: a best checkpoint is kept
    keep_every_steps: int | None = None
    source: str | None = None
    problem: str | None = None  # why the config could not be read, one line


UNKNOWN = Retention()


def config_of(argv: list[str]) -> str | None:
    """The value of the trainer's `--config` (either spelling), or None."""
    for i, a in enumerate(argv):
        if a == "--config" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--config="):
            return a.split("=", 1)[1]
    return None


class RetentionReader:
    """The retention of one config file, re-read only when the file changes (mtime, size)."""

    def __init__(self, path: str | None) -> None:
        self.path = path
        self._key: tuple[int, int] | None = None
        self._value = UNKNOWN

    def read(self) -> Retention:
        if self.path is None:
            return UNKNOWN
        try:
            st = os.stat(self.path)
        except OSError as exc:
            return Retention(problem=f"{self.path}: cannot read: {exc.strerror or exc}")
        key = (st.st_mtime_ns, st.st_size)
        if key != self._key:
            self._key, self._value = key, self._load(self.path)
        return self._value

    @staticmethod
    def _load(path: str) -> Retention:
        try:
            cfg = TrainConfig.load(path)
        except ConfigError as exc:
            return Retention(problem=str(exc))
        ck = cfg.checkpoint
        return Retention(ck.keep_last, cfg.eval.enabled, ck.keep_every_steps, source=path)


@dataclass(frozen=True)
class Disk:
    free: int  # bytes an unprivileged writer can still use
    checkpoint: int  # bytes of the newest complete checkpoint (0 before the first)
    slots: int  # checkpoints on disk at the peak of a write (1: retention unknown)
    held: int  # bytes of checkpoints already on disk that count toward those slots
    retention: Retention = UNKNOWN
    best: bool = False  # a best checkpoint is (or will be) kept

    @property
    def need(self) -> int:
        """Free bytes retention still needs: the slots' total less what is there, >= one."""
        if self.checkpoint == 0:
            return 0
        return max(self.checkpoint, self.checkpoint * self.slots - self.held)

    @property
    def low(self) -> bool:
        """Less free than retention will fill: a later checkpoint will fail."""
        return self.free < self.need

    @property
    def full(self) -> bool:
        """Less free than one checkpoint: the next checkpoint will fail."""
        return self.free < self.checkpoint

    def text(self) -> str:
        """`3.0 MiB free, checkpoint needs 5.0` (the trainer's ENOSPC wording); when the config
        gave the retention, what makes up the need: `..., checkpoints need 2.0 MiB: the newest
        checkpoint (1.0 MiB) x 3 checkpoints on disk at the peak of a write (checkpoint.keep_last
        2 + 1 being written), less 1.0 MiB already there`."""
        r = self.retention
        if r.source is None:
            return f"{self.free / MIB:.1f} MiB free, checkpoint needs {self.need / MIB:.1f}"
        kept = f"checkpoint.keep_last {r.keep_last}" + (" + best" if self.best else "")
        less = f", less {self.held / MIB:.1f} MiB already there" if self.held else ""
        every = (
            f"; keep_every_steps {r.keep_every_steps} keeps more on top"
            if r.keep_every_steps
            else ""
        )
        return (
            f"{self.free / MIB:.1f} MiB free, checkpoints need {self.need / MIB:.1f} MiB: the "
            f"newest checkpoint ({self.checkpoint / MIB:.1f} MiB) x {self.slots} checkpoints on "
            f"disk at the peak of a write ({kept} + 1 being written){less}{every}"
        )

    def one_text(self) -> str:
        """Free space against one checkpoint: `3.0 MiB free, checkpoint needs 5.0`."""
        return f"{self.free / MIB:.1f} MiB free, checkpoint needs {self.checkpoint / MIB:.1f}"

    def as_json(self) -> dict[str, float]:
        return {
            "free_mib": round(self.free / MIB, 1),
            "needed_mib": round(self.need / MIB, 1),
            "checkpoint_mib": round(self.checkpoint / MIB, 1),
            "checkpoints": self.slots,
        }


def _steps(run_dir: Path) -> dict[int, str]:
    """Complete checkpoint files by step."""
    found: dict[int, str] = {}
    try:
        with os.scandir(run_dir / "checkpoints") as it:
            for entry in it:
                m = _NAME.fullmatch(entry.name)
                if m:
                    found[int(m.group(1))] = entry.path
    except OSError:
        pass
    return found


def _size(path: str) -> int:
    try:
        return os.stat(path).st_size
    except OSError:  # pruned meanwhile
        return 0


def _best_step(run_dir: Path) -> int | None:
    try:
        m = _NAME.fullmatch(os.readlink(run_dir / "checkpoints" / BEST))
    except OSError:
        return None
    return int(m.group(1)) if m else None


def checkpoint_need(run_dir: Path) -> int:
    """Size in bytes of the newest complete checkpoint (highest step), 0 when there is none."""
    found = _steps(run_dir)
    return _size(found[max(found)]) if found else 0


def check(run_dir: Path, retention: Retention = UNKNOWN) -> Disk | None:
    """Free space where the checkpoints go (RUN/checkpoints, else RUN before it exists) against
    what retention needs; None when neither can be statted."""
    root = run_dir / "checkpoints"
    try:
        st = os.statvfs(root if root.is_dir() else run_dir)
    except OSError:
        return None
    free = st.f_bavail * st.f_frsize
    found = _steps(run_dir)
    size = _size(found[max(found)]) if found else 0
    if retention.source is None:
        return Disk(free=free, checkpoint=size, slots=1, held=0)
    best_step = _best_step(run_dir)
    best = retention.evaluates or best_step is not None
    counted = sorted(found)[-retention.keep_last :]
    if best_step in found and best_step not in counted:
        counted.append(best_step)
    held = sum(_size(found[s]) for s in counted)
    slots = retention.keep_last + int(best) + 1
    return Disk(free, size, slots, held, retention, best)
