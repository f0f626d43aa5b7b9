"""Import progress on stderr: a live bar on a terminal, one summary line in every case.

The bar (rich, which the project already carries through textual) shows the share of the input
read (bytes: the row count is unknown until the end), rows read, rows/s, rows kept and the ETA.
When stderr is not a terminal (a log file, a pipe, `dflashctl`'s capture) nothing is drawn:
redraws would only fill the log. `summary` is the line printed when the import is done.
"""

from __future__ import annotations

import sys
import time
from types import TracebackType
from typing import Self, TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    Progress,
    TaskID,
    TaskProgressColumn,
    TextColumn,
    TimeRemainingColumn,
)


class ImportProgress:
    """`with ImportProgress(size) as p: ... p.update(bytes, rows, kept)`; then `p.summary()`."""

    def __init__(self, total_bytes: int, stream: TextIO | None = None) -> None:
        self.stream = stream if stream is not None else sys.stderr
        self.total_bytes = max(1, total_bytes)
        self.started = time.monotonic()
        self.rows = self.kept = 0
        self.ended: float | None = None
        self._bar: Progress | None = None
        self._task: TaskID | None = None

    def __enter__(self) -> Self:
        self.started = time.monotonic()
        return self

    def update(self, done_bytes: int, rows: int, kept: int) -> None:
        """The first call (zeros, as reading begins) starts the clock and the bar: loading the
        tokenizer is not reading rows."""
        if self._task is None:
            self.started = time.monotonic()
            self._task = self._start_bar()
        self.rows, self.kept = rows, kept
        if self._bar is not None:
            self._bar.update(
                self._task,
                completed=min(done_bytes, self.total_bytes),
                rows=rows,
                rate=self.rate(),
                kept=kept,
            )

    def _start_bar(self) -> TaskID:
        if not self.stream.isatty():
            return TaskID(0)
        self._bar = Progress(
            TextColumn("import"),
            BarColumn(),
            TaskProgressColumn(),
            TextColumn("{task.fields[rows]:>11,} rows  {task.fields[rate]:>8,.0f} rows/s"),
            TextColumn("{task.fields[kept]:>11,} kept  ETA"),
            TimeRemainingColumn(),
            console=Console(file=self.stream),
        )
        task = self._bar.add_task("import", total=self.total_bytes, rows=0, rate=0.0, kept=0)
        self._bar.start()
        return task

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.ended = time.monotonic()
        if self._bar is not None:
            self._bar.stop()
            self._bar = None

    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.started

    def rate(self) -> float:
        return self.rows / max(self.seconds(), 1e-9)

    def summary(self) -> str:
        """`import: 12,345 rows read in 8.2 s (1,505 rows/s), 12,001 kept`."""
        seconds = self.seconds()
        return (
            f"import: {self.rows:,} rows read in {seconds:.1f} s ({self.rate():,.0f} rows/s), "
            f"{self.kept:,} kept"
        )
