"""Stop-aware bounded channels between pipeline stages, and clocks for time spent blocked.

Every blocking operation waits in short slices and re-checks a shared stop event, so a failure
anywhere (or a signal) unblocks every stage within ~POLL_S: the pipeline can never hang on a
queue whose peer died. Every channel is bounded: backpressure, not memory growth.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

T = TypeVar("T")
POLL_S = 0.05


class Stopped(Exception):
    """The shared stop event was set while a stage was blocked; the stage should return."""


class WaitClock:
    """Seconds one stage worker spent blocked on its input and on its output.

    A wait in progress counts up to now (`total`), so a status interval that falls inside a
    long wait reports it in that interval rather than all at once when the wait ends.
    """

    def __init__(self) -> None:
        self.input_s = 0.0
        self.output_s = 0.0
        self._since: dict[str, float] = {}

    def begin(self, kind: str) -> float:
        t0 = time.perf_counter()
        self._since[kind] = t0
        return t0

    def end(self, kind: str, t0: float) -> None:
        self._since.pop(kind, None)
        setattr(self, kind, getattr(self, kind) + time.perf_counter() - t0)

    def total(self, kind: str) -> float:
        since = self._since.get(kind)
        running = time.perf_counter() - since if since is not None else 0.0
        done: float = getattr(self, kind)
        return done + running


@contextlib.contextmanager
def _blocked(clock: WaitClock | None, kind: str) -> Iterator[None]:
    """Count the time inside as `clock`'s `kind` wait ("input_s" or "output_s"; no clock: none)."""
    if clock is None:
        yield
        return
    t0 = clock.begin(kind)
    try:
        yield
    finally:
        clock.end(kind, t0)


def put(q: queue.Queue[T], item: T, stop: threading.Event, clock: WaitClock | None = None) -> None:
    """Blocking put that gives up (raises Stopped) as soon as `stop` is set."""
    with _blocked(clock, "output_s"):
        while True:
            if stop.is_set():
                raise Stopped
            try:
                q.put(item, timeout=POLL_S)
                return
            except queue.Full:
                continue


def get(q: queue.Queue[T], stop: threading.Event, clock: WaitClock | None = None) -> T:
    """Blocking get that gives up (raises Stopped) as soon as `stop` is set."""
    with _blocked(clock, "input_s"):
        while True:
            if stop.is_set():
                raise Stopped
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                continue


class ReorderBuffer(Generic[T]):
    """A bounded channel keyed by sequence number that releases items strictly in order.

    Target workers finish batches out of order; the drafter must consume them in the sampler's
    order so results never depend on thread timing. `put(seq)` blocks while
    seq >= next + capacity (backpressure and a memory bound); the item with seq == next can
    always be put, so the worker holding the oldest batch is never blocked: no deadlock.
    """

    def __init__(self, capacity: int, start_seq: int = 0) -> None:
        if capacity < 1:
            raise ValueError("capacity must be >= 1")
        self.capacity = capacity
        self.next_seq = start_seq
        self._items: dict[int, T] = {}
        self._cond = threading.Condition()

    def put(self, seq: int, item: T, stop: threading.Event, clock: WaitClock | None = None) -> None:
        with _blocked(clock, "output_s"), self._cond:
            self._wait_until(lambda: seq < self.next_seq + self.capacity, stop)
            if seq < self.next_seq or seq in self._items:
                raise RuntimeError(f"sequence number {seq} delivered twice")
            self._items[seq] = item
            self._cond.notify_all()

    def wait_room(self, seq: int, stop: threading.Event, clock: WaitClock | None = None) -> None:
        """Block until `put(seq)` would not (counted as output wait, as a blocked put is)."""
        with _blocked(clock, "output_s"), self._cond:
            self._wait_until(lambda: seq < self.next_seq + self.capacity, stop)

    def get(self, stop: threading.Event, clock: WaitClock | None = None) -> tuple[int, T]:
        with _blocked(clock, "input_s"), self._cond:
            self._wait_until(lambda: self.next_seq in self._items, stop)
            return self._pop_next()

    def poll(self) -> tuple[int, T] | None:
        """The next item in order if it is here already, else None (never blocks)."""
        with self._cond:
            return self._pop_next() if self.next_seq in self._items else None

    def _wait_until(self, ready: Callable[[], bool], stop: threading.Event) -> None:
        """With the lock held: wait in POLL_S slices until `ready()`; Stopped once `stop` is set."""
        while not ready():
            if stop.is_set():
                raise Stopped
            self._cond.wait(POLL_S)

    def _pop_next(self) -> tuple[int, T]:
        """With the lock held and item `next_seq` here: take it, advance, wake the putters."""
        seq = self.next_seq
        item = self._items.pop(seq)
        self.next_seq += 1
        self._cond.notify_all()
        return seq, item

    def depth(self) -> int:
        """Packets ready or waiting for their turn (the status line's q_hs)."""
        return len(self._items)
