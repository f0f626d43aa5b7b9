"""The supervisor's free-space watch of RUN: `disk.check` against the retention the trainer's
config gives, a phase line each time it turns low or ok again (and once per new retention
problem), and the `low_disk` entry of supervisor.json while it is low.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from trainer.events import format_phase_line
from trainer.supervision import disk
from trainer.supervision.console import PREFIX, Console
from trainer.supervision.statefile import now_iso


class DiskWatch:
    def __init__(self, run_dir: Path, trainer_argv: list[str], console: Console) -> None:
        self.run_dir, self.console = run_dir, console
        self.retention = disk.RetentionReader(disk.config_of(trainer_argv))
        self._retention_problem: str | None = None
        self.checked = -float("inf")  # monotonic time of the last check
        self.low_disk: dict[str, Any] | None = None  # {free_mib, needed_mib, since} while low

    def check(self) -> disk.Disk | None:
        """Free space against one checkpoint (None: unknown); says each change of low/ok."""
        self.checked = time.monotonic()
        retention = self.retention.read()
        if retention.problem != self._retention_problem and retention.problem:
            self.console.say(
                f"{PREFIX}no checkpoint retention from the config ({retention.problem}): free "
                "space is checked against one checkpoint"
            )
        self._retention_problem = retention.problem
        d = disk.check(self.run_dir, retention)
        if d is None:
            return None
        was = self.low_disk
        if d.low:
            since = was["since"] if was else now_iso()
            if was is None:
                self.console.say(
                    format_phase_line(
                        "low_disk",
                        f"low: {d.text()} on {self.run_dir}; "
                        + ("the next checkpoint" if d.full else "a later checkpoint")
                        + " will fail unless space is freed",
                    ),
                    status_log=True,
                )
            self.low_disk = {**d.as_json(), "since": since}
        elif was is not None:
            self.console.say(
                format_phase_line("low_disk", f"ok again: {d.text()} on {self.run_dir}"),
                status_log=True,
            )
            self.low_disk = None
        return d
