"""The stall watchdog's input: new lines of RUN/status.log, parsed with trainer.events."""

from __future__ import annotations

from pathlib import Path

from trainer.events import (
    CheckpointEvent,
    ErrorEvent,
    Event,
    PhaseEvent,
    RegenEvent,
    StatusEvent,
    parse_line,
)

# Phases the supervisor prints itself: they are not the trainer's progress.
SUPERVISOR_PHASES = frozenset(
    {"restarting", "not_restarting", "gave_up", "low_disk", "state_stale"}
)


class LogTail:
    """New complete lines of a file from an offset; a truncated or replaced file starts over."""

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path = path
        self.offset = offset
        self._partial = b""

    @staticmethod
    def size(path: Path) -> int:
        try:
            return path.stat().st_size
        except OSError:
            return 0

    def read(self) -> list[str]:
        try:
            with open(self.path, "rb") as fh:
                end = fh.seek(0, 2)
                if end < self.offset:  # truncated or replaced: read it from the start
                    self.offset, self._partial = 0, b""
                fh.seek(self.offset)
                data = fh.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        *lines, self._partial = data.split(b"\n")
        return [ln.decode("utf-8", "replace") for ln in lines]


class Progress:
    """Progress of one attempt: the last time it advanced, whether it trained a step yet.

    Progress = a status line whose step is higher than any before in this attempt (a status line
    repeating its step is not: a hung drafter leaves the monitor printing), a checkpoint line,
    or a trainer phase line; for a regeneration job, each of its `Regen:` status lines (printed
    while it waits for a server too: it is alive; its requests have timeouts of their own).
    Before the first step (a status or checkpoint line past the step
    it started from) the attempt is "starting", under the longer startup timeout.
    """

    def __init__(self, now: float) -> None:
        self.last_progress = now
        self.high = 0  # the highest step seen (the resumed step once "Resuming" is printed)
        self.trained = False
        self.checkpoint_step: int | None = None
        self.resumed_step: int | None = None  # None until the attempt says where it starts
        self.errors: list[str] = []

    def feed(self, ev: Event, now: float) -> None:
        if isinstance(ev, StatusEvent):
            if ev.step > self.high:
                self.high, self.trained, self.last_progress = ev.step, True, now
        elif isinstance(ev, RegenEvent):
            self.trained, self.last_progress = True, now
        elif isinstance(ev, CheckpointEvent):
            self.checkpoint_step = max(ev.step, self.checkpoint_step or 0)
            self.last_progress = now
            if ev.step > self.high:  # a checkpoint past the start: it trained (the status
                self.high, self.trained = ev.step, True  # interval may not have come yet)
        elif isinstance(ev, PhaseEvent) and ev.phase not in SUPERVISOR_PHASES:
            self.last_progress = now
            if ev.phase == "resuming":
                step = _step_of(ev.detail)
                if step is not None:
                    self.resumed_step = step
                    self.high = max(self.high, step)
            elif ev.phase in ("starting", "running") and self.resumed_step is None:
                self.resumed_step = 0  # no checkpoint: started over
        elif isinstance(ev, ErrorEvent):
            self.errors.append(ev.message)

    def feed_lines(self, lines: list[str], now: float) -> None:
        for line in lines:
            self.feed(parse_line(line), now)

    def idle_limit(self, stall_timeout_s: float, startup_timeout_s: float) -> float:
        return stall_timeout_s if self.trained else startup_timeout_s


def _step_of(detail: str) -> int | None:
    # "step=20 path=/run/checkpoints/step-00000020.pt"
    head = detail.split(" ", 1)[0]
    if head.startswith("step=") and head[5:].isdigit():
        return int(head[5:])
    return None
