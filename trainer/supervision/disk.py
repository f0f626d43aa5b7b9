"""Free space in the run directory against what the next checkpoint needs (torch-free).

The next checkpoint is taken to be as large as the newest complete `checkpoints/step-*.pt`
(0 before the first: nothing to compare against yet); a statvfs and a directory listing, so the
supervisor can afford it every few seconds.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

MIB = 1024 * 1024
_NAME = re.compile(r"step-(\d{8,})\.pt")  # trainer.pipeline.checkpoint's complete-file name


@dataclass(frozen=True)
class Disk:
    free: int  # bytes an unprivileged writer can still use
    need: int  # bytes of the newest complete checkpoint (0 before the first)

    @property
    def low(self) -> bool:
        return self.free < self.need

    def text(self) -> str:
        """`3.0 MiB free, checkpoint needs 5.0` (the trainer's ENOSPC wording)."""
        return f"{self.free / MIB:.1f} MiB free, checkpoint needs {self.need / MIB:.1f}"

    def as_json(self) -> dict[str, float]:
        return {"free_mib": round(self.free / MIB, 1), "needed_mib": round(self.need / MIB, 1)}


def checkpoint_need(run_dir: Path) -> int:
    """Size in bytes of the newest complete checkpoint (highest step), 0 when there is none."""
    newest: tuple[int, str] | None = None
    try:
        with os.scandir(run_dir / "checkpoints") as it:
            for entry in it:
                m = _NAME.fullmatch(entry.name)
                if m and (newest is None or int(m.group(1)) > newest[0]):
                    newest = (int(m.group(1)), entry.path)
    except OSError:
        return 0
    if newest is None:
        return 0
    try:
        return os.stat(newest[1]).st_size
    except OSError:  # pruned meanwhile
        return 0


def check(run_dir: Path) -> Disk | None:
    """Free space against the next checkpoint's size; None when the run dir cannot be statted."""
    try:
        st = os.statvfs(run_dir)
    except OSError:
        return None
    return Disk(free=st.f_bavail * st.f_frsize, need=checkpoint_need(run_dir))
