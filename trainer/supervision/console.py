"""The supervisor's lines: on stdout (the tmux pane) and in RUN/console.log, and in
RUN/status.log too for the events dflashctl's parser reads there (phase lines).
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import TextIO

from trainer.events import format_error_line

PREFIX = "Supervisor: "


class Console:
    def __init__(self, run_dir: Path, out: TextIO) -> None:
        self.run_dir, self.out = run_dir, out
        self._failed: set[str] = set()  # log files whose last append failed (said once)

    def say(self, text: str, status_log: bool = False) -> None:
        """A line on stdout and in console.log (and status.log for events the parser reads).
        A log that cannot be appended to is one ERROR line until an append works again (a
        full disk must not bury the pane's lines under its own)."""
        with contextlib.suppress(OSError):  # the pane may be gone (SIGHUP): the files remain
            print(text, file=self.out, flush=True)
        for name in ("console.log", "status.log") if status_log else ("console.log",):
            try:
                with open(self.run_dir / name, "a") as fh:
                    fh.write(text + "\n")
            except OSError as exc:
                if name not in self._failed:
                    self._failed.add(name)
                    self.error(f"{self.run_dir / name}: cannot append: {exc}")
            else:
                self._failed.discard(name)

    def error(self, problem: str) -> None:
        """An error line on stdout only (the files may be what failed)."""
        print(format_error_line(problem), file=self.out, flush=True)
