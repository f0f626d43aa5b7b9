"""The supervisor's free-space watch of every filesystem the trainer writes to
(`filesystems.spaces`: RUN, RUN/checkpoints, the exports, the trackers' dirs, each filesystem
once) against the retention the trainer's config gives: a phase line naming the filesystem each
time one turns low or ok again (and once per new retention problem), and supervisor.json's
`low_disk` (the first low filesystem, the checkpoints' first) and `low_disks` (every low one)
while any is low.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainer.events import format_phase_line
from trainer.supervision import disk, filesystems
from trainer.supervision.console import PREFIX, Console
from trainer.supervision.filesystems import Space
from trainer.supervision.statefile import now_iso


class DiskWatch:
    def __init__(self, run_dir: Path, trainer_argv: list[str], console: Console) -> None:
        self.run_dir, self.console = run_dir, console
        self.retention = disk.RetentionReader(disk.config_of(trainer_argv))
        self._retention_problem: str | None = None
        self.checked = -float("inf")  # monotonic time of the last check
        self._low: dict[Path, dict[str, Any]] = {}  # by the filesystem's name, while low

    @property
    def low_disk(self) -> dict[str, Any] | None:
        """{free_mib, needed_mib, path, holds, since, ...} of the first low filesystem."""
        return next(iter(self._low.values()), None)

    @property
    def low_disks(self) -> list[dict[str, Any]]:
        """Every low filesystem's entry, the checkpoints' first."""
        return list(self._low.values())

    def check(self) -> Space | None:
        """Measure every filesystem, say each change of low/ok; the checkpoints' filesystem
        (None: it cannot be statted)."""
        self.checked = time.monotonic()
        retention = self.retention.read()
        if retention.problem != self._retention_problem and retention.problem:
            self.console.say(
                f"{PREFIX}no checkpoint retention from the config ({retention.problem}): free "
                "space is checked against one checkpoint"
            )
        self._retention_problem = retention.problem
        spaces = filesystems.spaces(self.run_dir, retention)
        low: dict[Path, dict[str, Any]] = {}
        for sp in spaces:
            was = self._low.get(sp.path)
            if sp.low:
                if was is None:
                    self._say(f"low: {sp.text()}; {sp.consequence()} unless space is freed")
                low[sp.path] = {**sp.as_json(), "since": was["since"] if was else now_iso()}
            elif was is not None:
                self._say(f"ok again: {sp.text()}")
        self._low = low
        return next((sp for sp in spaces if sp.checkpoints is not None), None)

    def _say(self, detail: str) -> None:
        self.console.say(format_phase_line("low_disk", detail), status_log=True)
