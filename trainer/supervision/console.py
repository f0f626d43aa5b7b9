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

    def say(self, text: str, status_log: bool = False) -> None:
        """A line on stdout and in console.log (and status.log for events the parser reads)."""
        with contextlib.suppress(OSError):  # the pane may be gone (SIGHUP): the files remain
            print(text, file=self.out, flush=True)
        for name in ("console.log", "status.log") if status_log else ("console.log",):
            try:
                with open(self.run_dir / name, "a") as fh:
                    fh.write(text + "\n")
            except OSError as exc:
                print(
                    format_error_line(f"{self.run_dir / name}: cannot append: {exc}"), file=self.out
                )

    def error(self, problem: str) -> None:
        """An error line on stdout only (the files may be what failed)."""
        print(format_error_line(problem), file=self.out, flush=True)
