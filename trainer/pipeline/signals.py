"""SIGINT/SIGTERM: the first asks the drafter to finish its step, checkpoint and stop; a second
stops at once (no more data is waited for); once the stop is recorded, later ones are ignored,
so a late Ctrl-C cannot turn a completed stop into a signal death (exit 130)."""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass
from types import FrameType

from trainer.pipeline.status import Reporter


@dataclass(frozen=True)
class Received:
    name: str  # SIGINT | SIGTERM
    at: float  # monotonic time
    late: bool  # came after the stop's checkpoint was written (it changes nothing)


class StopSignals:
    """The signals a run received, and how its stop is going."""

    def __init__(self, reporter: Reporter, stop_now: threading.Event) -> None:
        self.reporter = reporter
        self.stop_now = stop_now  # the pipeline's stop event: set by a second signal
        self.requested = threading.Event()  # the drafter checkpoints after its current step
        self.received: list[Received] = []
        self.name: str | None = None  # the first signal's name
        self.stopped = False  # the drafter stopped for the signal (its checkpoint came first)
        self.done = False  # the outcome is recorded: later signals are ignored
        self._announced = False
        self._lock = threading.Lock()

    @property
    def second_stops_at_once(self) -> bool:
        """A second signal came before the first stop's checkpoint: stop with no more steps."""
        return len(self.received) > 1 and not self.received[1].late

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._handle)
            signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        # Only flags here: the main thread may hold the reporter's lock.
        if self.done:
            return
        late = self.stopped  # the first stop already checkpointed and returned
        name = signal.Signals(signum).name
        self.received.append(Received(name, time.monotonic(), late))
        if self.requested.is_set():
            if not late:
                self.stop_now.set()  # second signal: stop now
            return
        self.name = name
        self.requested.set()

    def ignore(self) -> None:
        """The outcome is recorded: a late Ctrl-C must not kill the exiting process (exit 130)."""
        self.done = True
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)

    def announce(self) -> None:
        """Print the stopping line once, from whichever thread sees the request first.

        The monitor polls every 0.1 s; the drafter can finish its step and checkpoint before
        that, so it announces too, and the line always precedes the stop's checkpoint line.
        """
        with self._lock:
            if self._announced:
                return
            self._announced = True
        self.reporter.phase("stopping", f"({self.name})")

    def detail(self, step: int, saved: int, saved_name: str) -> str | None:
        """One line on how a signalled stop ended, for run-state.json (None: no signal)."""
        if not self.received:
            return None
        first, t0 = self.received[0].name, self.received[0].at
        if saved >= step:
            kept = f"checkpoint {saved_name} holds step {step}"
        elif saved:
            kept = f"steps {saved + 1}-{step} lost: last checkpoint {saved_name}"
        else:
            kept = f"steps 1-{step} lost: no checkpoint"
        if len(self.received) == 1:
            return f"{first}: finished step {step} and stopped; {kept}"
        second = self.received[1]
        n = len(self.received)
        more = f" (+{n - 2} more)" if n > 2 else ""
        if second.late:
            return (
                f"{first}: finished step {step} and stopped; {kept}; {second.name} "
                f"{second.at - t0:.1f} s later{more} came after that checkpoint and changed nothing"
            )
        return (
            f"second signal {second.name} {second.at - t0:.1f} s after {first}{more}: stopped at "
            f"once after step {step}; {kept}"
        )
