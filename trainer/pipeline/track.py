"""The run's experiment trackers (TensorBoard, W&B), fed the lines the run prints."""

from __future__ import annotations

import threading

from trainer.events import EvalEvent, StatusEvent, parse_line
from trainer.pipeline.status import Reporter
from trainer.tracking import Tracker


class TrackerSink:
    """Log the figures of a printed status or Eval line, read back by the line parser (so the
    trackers hold exactly what the TUI shows). A tracker never stops training: each backend
    warns once and drops out (trainer.tracking); anything else is one warning here."""

    def __init__(self, reporter: Reporter) -> None:
        self.reporter = reporter
        self.tracker: Tracker | None = None  # set on the main rank once trackers are open
        self._lock = threading.Lock()  # the monitor and the drafter both log

    def track(self, line: str) -> None:
        if self.tracker is None:
            return
        from trainer.tracking import log_event

        ev = parse_line(line)
        if not isinstance(ev, StatusEvent | EvalEvent):
            return
        with self._lock:
            if self.tracker is None:
                return
            try:
                log_event(self.tracker, ev)
            except Exception as exc:
                self.tracker = None
                self.reporter.warn(f"tracking: logging failed, trackers are off ({exc!r})")

    def close(self) -> None:
        """Every exit path (finished, stopped, failed): flush and close once."""
        with self._lock:
            tracker, self.tracker = self.tracker, None
        if tracker is not None:
            try:
                tracker.close()
            except Exception as exc:
                self.reporter.warn(f"tracking: close failed ({exc!r})")
