"""The one follow loop over run/status.log: typed events, one backoff, one read position.

`LogFollower` drives one connection at a time (`LogSource.tail_log`, a single `tail -F` that ends
or raises when its link drops) and reconnects after a `Backoff` delay, forever or up to
`max_attempts`. What it yields is typed, so no caller parses a link report out of free text:

* `Connected(from_line)`: a connection is being opened, reading from that 0-based line;
* `Line(text, number)`: one newline-terminated line and its 0-based number in status.log;
* `Lost(reason, retry_in)`: the link dropped (or the tail ended); the next try is in `retry_in` s;
* `LogRestarted()`: status.log was started over (found shorter than what was read, or gone):
  it is read again from its first line, because skipping a new run's first lines would be worse
  than repeating a few.

The follower owns the read position (the count of lines delivered): a reconnect neither
repeats nor skips a line. It is the one place that decides the log started over, on every
reconnect and whenever a caller reports a line count it saw (`saw_line_count`, e.g. from a
status poll). `reconnect_now` drops the current connection, or cuts a backoff wait short.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Protocol

from dflashctl.remote.transport import HostKeyError, HostUnreachable, TransportError


@dataclass(frozen=True, slots=True)
class Line:
    text: str
    number: int
    """0-based line number in status.log; the position after it is `number + 1`."""


@dataclass(frozen=True, slots=True)
class Connected:
    from_line: int


@dataclass(frozen=True, slots=True)
class Lost:
    reason: str
    retry_in: float
    """Seconds until the next connection attempt (cut short by `reconnect_now`)."""


@dataclass(frozen=True, slots=True)
class LogRestarted:
    pass


FollowEvent = Line | Connected | Lost | LogRestarted


class LogSource(Protocol):
    """The two primitives of `dflashctl.runs.service.RunService` the loop drives."""

    def tail_log(self, from_line: int) -> AsyncIterator[str]:
        """One connection's tail of status.log from 0-based `from_line` (newline-terminated
        lines only); ends or raises when that link drops."""
        ...

    async def log_line_count(self) -> int | None:
        """Lines in status.log now: 0 when it is gone, None when it cannot be told."""
        ...


@dataclass(frozen=True, slots=True)
class Backoff:
    """Capped exponential reconnect delay, `initial * factor**attempt` up to `maximum`, times a
    random factor in [1 - jitter, 1 + jitter] (0: exact, what the TUI uses; the CLI uses 0.2 so
    many clients of one host do not reconnect in step). `rand` is injectable (a seeded
    `random.Random(n).random`) so tests are deterministic."""

    initial: float = 1.0
    factor: float = 2.0
    maximum: float = 30.0
    jitter: float = 0.0
    rand: Callable[[], float] = random.random

    def delay(self, attempt: int) -> float:
        """Seconds to wait before retry number `attempt` (0-based)."""
        base = min(self.maximum, self.initial * self.factor ** max(0, attempt))
        if not self.jitter:
            return base
        return base * (1.0 - self.jitter + 2.0 * self.jitter * self.rand())


def link_retryable(exc: Exception) -> bool:
    """A dropped link is retried; a host key problem is not (retrying cannot fix it), and
    neither is anything that is not a link failure."""
    return isinstance(exc, HostUnreachable) and not isinstance(exc, HostKeyError)


def any_failure(exc: Exception) -> bool:
    """Retry whatever went wrong (the TUI: one host's failure is that host's state)."""
    return True


def describe_failure(exc: BaseException) -> str:
    """One line for a failed connection: a transport error's own message (it names the host and
    what failed), anything else prefixed with its type."""
    text = str(exc).strip().splitlines()
    if isinstance(exc, TransportError):
        return text[0] if text else type(exc).__name__
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


@dataclass(frozen=True, slots=True)
class ReadMark:
    """How many restarts had been seen and how many lines read, at one moment."""

    restarts: int
    position: int


class _Interrupted(Exception):
    """`reconnect_now` (or a reported restart) dropped the connection on purpose."""


_END = object()
_WAKE = object()


class LogFollower:
    """Follows one host's status.log across dropped links; `events()` is the loop.

    `delay` maps the 0-based attempt number to seconds (usually `Backoff(...).delay`); it is
    reset by every line received and by `reconnect_now`. `retryable` decides which failures
    are a lost link to retry (the rest are raised); `max_attempts` gives up (HostUnreachable
    naming `name`) after that many failed connections in a row.
    """

    def __init__(
        self,
        source: LogSource,
        from_line: int = 0,
        *,
        delay: Callable[[int], float] | None = None,
        retryable: Callable[[Exception], bool] = link_retryable,
        max_attempts: int | None = None,
        name: str = "status.log",
    ) -> None:
        self.source = source
        self.position = from_line
        """Lines delivered so far: the 0-based line the next connection reads from."""
        self._delay = delay or Backoff().delay
        self._retryable = retryable
        self._max_attempts = max_attempts
        self._name = name
        self._wake = asyncio.Event()
        self._restart_pending = False
        self._restarts = 0
        self._queue: asyncio.Queue[object] | None = None

    def reconnect_now(self) -> None:
        """Drop the current connection (or end a backoff wait) and connect again at once."""
        self._wake.set()
        if self._queue is not None:
            self._queue.put_nowait(_WAKE)

    def restart(self) -> None:
        """status.log started over (a fresh run): read it again from its first line."""
        self._restart_pending = True
        self.reconnect_now()

    def mark(self) -> ReadMark:
        """Where reading stands now; pass it to `saw_line_count` with a count taken after."""
        return ReadMark(self._restarts, self.position)

    def saw_line_count(self, count: int | None, since: ReadMark) -> bool:
        """A line count of status.log seen elsewhere (a status poll), taken after `since`: if
        it is below what had been read by then, the log started over and is read again from
        its first line (True). Comparing with the position from before the count was taken
        means lines delivered meanwhile are never mistaken for a shrink."""
        if since.restarts == self._restarts and self._started_over(count, since.position):
            self.restart()
            return True
        return False

    @staticmethod
    def _started_over(count: int | None, lines_read: int) -> bool:
        return count is not None and count < lines_read

    async def events(self) -> AsyncGenerator[FollowEvent, None]:
        """Connected, Line..., Lost (and LogRestarted) events, forever (or until
        `max_attempts`); a failure `retryable` refuses is raised."""
        attempt = 0
        reconnecting = False
        while True:
            self._wake.clear()
            try:
                if self._restart_pending or (
                    reconnecting
                    and self.position > 0
                    and self._started_over(await self.source.log_line_count(), self.position)
                ):
                    self._restart_pending = False
                    self._restarts += 1
                    self.position = 0
                    yield LogRestarted()
                reconnecting = True
                yield Connected(self.position)
                async with contextlib.aclosing(self._connection()) as lines:
                    async for text in lines:
                        number = self.position
                        self.position += 1
                        attempt = 0
                        yield Line(text, number)
                reason = "stream ended"
            except _Interrupted:
                attempt = 0
                continue
            except Exception as exc:
                if not self._retryable(exc):
                    raise
                reason = describe_failure(exc)
            attempt += 1
            if self._max_attempts is not None and attempt > self._max_attempts:
                raise HostUnreachable(
                    f"{self._name}: giving up after {self._max_attempts} attempts: {reason}"
                )
            wait = self._delay(attempt - 1)
            yield Lost(reason, wait)
            if not self._wake.is_set():
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), wait)

    async def _connection(self) -> AsyncGenerator[str, None]:
        """One connection's lines, read by a task of its own so `reconnect_now` can drop it
        between lines (the queue is unbounded: its readers, a reducer or a print, outpace a
        status log)."""
        if self._wake.is_set():
            raise _Interrupted
        queue: asyncio.Queue[object] = asyncio.Queue()
        self._queue = queue
        pump = asyncio.create_task(self._pump(self.position, queue))
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return
                if item is _WAKE:
                    raise _Interrupted
                if isinstance(item, Exception):
                    raise item
                assert isinstance(item, str)
                yield item
        finally:
            self._queue = None
            pump.cancel()
            await asyncio.gather(pump, return_exceptions=True)

    async def _pump(self, from_line: int, queue: asyncio.Queue[object]) -> None:
        try:  # a cancel lands inside the tail (the pump only ever waits there), which closes it
            async for line in self.source.tail_log(from_line):
                queue.put_nowait(line)
        except Exception as exc:  # handed to the reader, which decides what it means
            queue.put_nowait(exc)
            return
        queue.put_nowait(_END)


async def lines_of(events: AsyncGenerator[FollowEvent, None]) -> AsyncGenerator[str, None]:
    """Only the lines' text of a follow (for callers that show no link state); closing this
    closes the follow (its live tail ends at once)."""
    async with contextlib.aclosing(events):
        async for event in events:
            if isinstance(event, Line):
                yield event.text
