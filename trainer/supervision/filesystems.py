"""Every filesystem the trainer writes to, each once, against what it will still write there
(torch-free).

The trainer writes into RUN (logs, run-state, metrics), RUN/checkpoints, the exports at the end
(RUN/export, -bf16, -best, -best-bf16) and the trackers' files (RUN/tb, RUN/wandb). Any of them
may be a mount or a symlink of its own (a separate checkpoint volume is common), so each is
resolved to its filesystem (`st_dev` of the directory, or of its nearest existing parent when
the trainer has not made it yet) and every distinct filesystem is measured once, named by the
shallowest of the trainer's directories on it. What a filesystem needs:

- checkpoints: what retention keeps (`disk.check`: the newest checkpoint x the checkpoints on
  disk at the peak of a write, less those already there). The exports fit in the slot of the
  one being written: none is being written when they are made, after the last checkpoint.
- exports, without the checkpoints: the newest checkpoint's size. The four exports hold the
  drafter three times (fp32 + bf16, of the last and of the best); a checkpoint holds it three
  times too (the fp32 weights and Adam's two moments).
- logs and trackers only: `LOG_RESERVE`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from trainer.model.export_files import run_export_dirs
from trainer.supervision.disk import MIB, UNKNOWN, Disk, Retention, check, checkpoint_need

LOG_RESERVE = 16 * MIB
"""What a filesystem holding only logs and tracker files should keep free: about a day of
status lines and metrics.jsonl at one step a second."""

# (what, directory relative to RUN); the names are the trainer's:
# trainer.pipeline.checkpoint.checkpoint_dir, runner._export, trainer.tracking (TB_DIR, wandb's
# dir=RUN). tests/pipeline/test_supervise_disk.py keeps them equal.
WRITES: tuple[tuple[str, str], ...] = (
    ("checkpoints", "checkpoints"),
    *(("exports", name) for name in run_export_dirs()),
    ("logs", "."),
    ("tracker", "tb"),
    ("tracker", "wandb"),
)


@dataclass(frozen=True)
class Space:
    """One filesystem the trainer writes to: free space against what it will still write."""

    path: Path  # the shallowest of the trainer's directories on it (what the lines name)
    holds: tuple[str, ...]  # what the trainer writes there, in WRITES order
    free: int
    need: int
    checkpoints: Disk | None  # the retention math, when the checkpoints are here

    @property
    def low(self) -> bool:
        """Less free than what it will still hold."""
        return self.free < self.need

    @property
    def full(self) -> bool:
        """The checkpoints are here and not even the next one fits."""
        return self.checkpoints is not None and self.checkpoints.full

    def text(self) -> str:
        """`0.5 MiB free on RUN/checkpoints, checkpoint needs 1.0`."""
        where = f"on {self.path}"
        if self.checkpoints is not None:
            free, _, rest = self.checkpoints.text().partition(" free, ")
            return f"{free} free {where}, {rest}"
        if "exports" in self.holds:
            return (
                f"{self.free / MIB:.1f} MiB free {where}, the exports at the end need "
                f"{self.need / MIB:.1f} MiB (the newest checkpoint's size)"
            )
        return f"{self.free / MIB:.1f} MiB free {where}, logs keep {self.need / MIB:.0f} MiB"

    def consequence(self) -> str:
        """What fails unless space is freed."""
        if self.checkpoints is not None:
            return ("the next" if self.full else "a later") + " checkpoint will fail"
        if "exports" in self.holds:
            return "the export at the end will fail"
        return "logs and tracker files will stop being written"

    def as_json(self) -> dict[str, object]:
        """supervisor.json's `low_disk`/`low_disks` entry: the figures, and the supervisor's own
        words for them (`text`, `consequence`), which status and watch show as they are."""
        out: dict[str, object] = {
            "path": str(self.path),
            "holds": list(self.holds),
            "text": self.text(),
            "consequence": self.consequence(),
        }
        if self.checkpoints is not None:
            return {**self.checkpoints.as_json(), **out}
        return {
            "free_mib": round(self.free / MIB, 1),
            "needed_mib": round(self.need / MIB, 1),
            **out,
        }


def _device(path: Path) -> tuple[int, Path] | None:
    """(st_dev, the path statted): `path`'s filesystem, or its nearest existing parent's."""
    for p in (path, *path.parents):
        try:
            return os.stat(p).st_dev, p
        except OSError:
            continue
    return None


def _free(path: Path) -> int | None:
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def spaces(run_dir: Path, retention: Retention = UNKNOWN) -> list[Space]:
    """Each filesystem the trainer writes to, once, the one holding the checkpoints first;
    a filesystem that cannot be statted is left out."""
    groups: dict[int, tuple[Path, list[tuple[str, Path]]]] = {}
    for what, rel in WRITES:
        path = Path(os.path.normpath(run_dir / rel))
        found = _device(path)
        if found is not None:
            groups.setdefault(found[0], (found[1], []))[1].append((what, path))
    out: list[Space] = []
    for probe, members in groups.values():
        holds = tuple(dict.fromkeys(what for what, _ in members))
        name = min((p for _, p in members), key=lambda p: len(p.parts))
        if "checkpoints" in holds:
            d = check(run_dir, retention)
            if d is not None:
                out.insert(0, Space(name, holds, d.free, d.need, d))
            continue
        free = _free(probe)
        if free is None:
            continue
        need = checkpoint_need(run_dir) if "exports" in holds else LOG_RESERVE
        out.append(Space(name, holds, free, need, None))
    return out
