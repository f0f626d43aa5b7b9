"""The one follow loop (dflashctl.runs.follow): typed events, one backoff, the read position it owns.

A scripted LogSource stands in for RunControl's two primitives; the real ones over SSH and a
local transport are driven through `RunControl.follow` in test_faults.py / test_local.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from dflashctl.remote.transport import CommandTimeout, HostKeyError, HostUnreachable
from dflashctl.runs.follow import (
    Backoff,
    Connected,
    FollowEvent,
    Line,
    LogFollower,
    LogRestarted,
    LogSource,
    Lost,
    any_failure,
    describe_failure,
    link_retryable,
)
from tests import budget

pytestmark = pytest.mark.timeout(30)


@dataclass
class ScriptedLog:
    """status.log on a host whose link drops after `drop_every` lines per connection."""

    lines: list[str]
    drop_every: int | None = None
    known: bool = True
    """False: log_line_count cannot tell (None), as after a command timeout."""
    fail: list[BaseException] = field(default_factory=list)
    """Raised by the next connections, one each, before any line."""
    tails: list[int] = field(default_factory=list)
    counts: int = 0
    closed: int = 0

    async def tail_log(self, from_line: int) -> AsyncIterator[str]:
        self.tails.append(from_line)
        try:
            if self.fail:
                raise self.fail.pop(0)
            for sent, line in enumerate(self.lines[from_line:]):
                if self.drop_every is not None and sent == self.drop_every:
                    raise HostUnreachable("fake: stream lost: connection reset")
                yield line
            await asyncio.Event().wait()  # tail -F: the stream stays open
        finally:
            self.closed += 1

    async def log_line_count(self) -> int | None:
        self.counts += 1
        return len(self.lines) if self.known else None


def record(into: list[int], attempt: int) -> float:
    into.append(attempt)
    return 0.0


def _source(log: ScriptedLog) -> LogSource:
    return log


async def take(follower: LogFollower, n_lines: int) -> list[FollowEvent]:
    """Events until `n_lines` Line events have arrived."""
    out: list[FollowEvent] = []
    async with contextlib.aclosing(follower.events()) as events:
        async for ev in events:
            out.append(ev)
            if sum(isinstance(e, Line) for e in out) == n_lines:
                break
    return out


def texts(events: list[FollowEvent]) -> list[str]:
    return [e.text for e in events if isinstance(e, Line)]


async def test_lines_survive_dropped_links_without_repeats_or_gaps() -> None:
    log = ScriptedLog([f"line {i}" for i in range(20)], drop_every=7)
    delays: list[int] = []
    follower = LogFollower(_source(log), delay=lambda a: record(delays, a))
    events = await take(follower, 20)
    assert texts(events) == [f"line {i}" for i in range(20)]
    assert [e.number for e in events if isinstance(e, Line)] == list(range(20))
    assert [e for e in events if isinstance(e, Connected)] == [
        Connected(0),
        Connected(7),
        Connected(14),
    ]
    lost = [e for e in events if isinstance(e, Lost)]
    assert lost == [Lost("fake: stream lost: connection reset", 0.0)] * 2
    assert delays == [0, 0]  # every line received resets the backoff
    assert log.tails == [0, 7, 14] and log.counts == 2  # the length is asked once per reconnect
    assert follower.position == 20


async def test_a_log_found_shorter_on_reconnect_is_read_from_its_first_line() -> None:
    log = ScriptedLog([f"line {i}" for i in range(20)], drop_every=7)
    follower = LogFollower(_source(log), delay=lambda a: 0.0)
    got: list[FollowEvent] = []
    async with contextlib.aclosing(follower.events()) as events:
        async for ev in events:
            got.append(ev)
            if ev == Line("line 13", 13):
                log.lines = [f"new {i}" for i in range(5)]  # replaced while the link is down
            if ev == Line("new 4", 4):
                break
    assert texts(got) == [f"line {i}" for i in range(14)] + [f"new {i}" for i in range(5)]
    restarted = got.index(LogRestarted())
    assert isinstance(got[restarted - 1], Lost) and got[restarted + 1] == Connected(0)
    assert log.tails == [0, 7, 0]


async def test_an_unknown_line_count_keeps_the_position() -> None:
    log = ScriptedLog([f"line {i}" for i in range(6)], drop_every=3, known=False)
    follower = LogFollower(_source(log), delay=lambda a: 0.0)
    assert texts(await take(follower, 6)) == [f"line {i}" for i in range(6)]
    assert log.tails == [0, 3]


async def test_a_host_key_failure_is_raised_not_retried_by_default() -> None:
    log = ScriptedLog(["a"], fail=[HostKeyError("fake: host key CHANGED")])
    with pytest.raises(HostKeyError, match="CHANGED"):
        await take(LogFollower(_source(log), delay=lambda a: 0.0), 1)
    assert log.tails == [0]
    assert not link_retryable(CommandTimeout("x")) and not link_retryable(ValueError("x"))
    assert link_retryable(HostUnreachable("x")) and any_failure(HostKeyError("x"))


async def test_any_failure_retries_everything_and_says_what_it_was() -> None:
    log = ScriptedLog(
        ["a", "b"],
        fail=[ConnectionRefusedError("ssh: connect to host h port 22: Connection refused")],
    )
    follower = LogFollower(_source(log), retryable=any_failure, delay=lambda a: 0.0)
    events = await take(follower, 2)
    assert events[:2] == [
        Connected(0),
        Lost("ConnectionRefusedError: ssh: connect to host h port 22: Connection refused", 0.0),
    ]
    assert texts(events) == ["a", "b"]


async def test_gives_up_after_max_attempts_naming_the_host() -> None:
    log = ScriptedLog(["a"], fail=[HostUnreachable(f"h: down {i}") for i in range(5)])
    follower = LogFollower(_source(log), delay=lambda a: 0.0, max_attempts=2, name="kpro6")
    with pytest.raises(HostUnreachable, match=r"^kpro6: giving up after 2 attempts: h: down 2$"):
        await take(follower, 1)
    assert log.tails == [0, 0, 0]


async def test_reconnect_now_cuts_a_backoff_wait_short() -> None:
    log = ScriptedLog(["a", "b"], fail=[HostUnreachable("h: down")])
    # a backoff longer than any test budget: only a cut-short wait reconnects within it
    follower = LogFollower(_source(log), delay=Backoff(initial=3600.0, maximum=3600.0).delay)
    events = follower.events()
    assert await anext(events) == Connected(0)
    assert await anext(events) == Lost("h: down", 3600.0)
    waiting = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.05)
    assert not waiting.done()  # in the hour's wait
    follower.reconnect_now()
    async with asyncio.timeout(budget.left()):
        assert await waiting == Connected(0)
        assert await anext(events) == Line("a", 0)
    await events.aclose()


async def test_reconnect_now_drops_a_live_connection_and_follows_on_from_the_position() -> None:
    log = ScriptedLog(["a", "b"])
    follower = LogFollower(_source(log), delay=lambda a: 0.0)
    events = follower.events()
    assert [await anext(events) for _ in range(3)] == [Connected(0), Line("a", 0), Line("b", 1)]
    pending = asyncio.ensure_future(anext(events))  # the tail is open, no line yet
    await asyncio.sleep(0.05)
    log.lines.append("c")
    follower.reconnect_now()
    async with asyncio.timeout(budget.left()):
        assert await pending == Connected(2)
        assert await anext(events) == Line("c", 2)
    assert log.tails == [0, 2] and log.closed == 1  # the dropped connection's tail was closed
    await events.aclose()
    assert log.closed == 2  # closing the events closes the open tail


async def test_a_line_count_seen_by_a_poll_restarts_only_when_below_the_mark() -> None:
    log = ScriptedLog([f"line {i}" for i in range(6)])
    follower = LogFollower(_source(log), delay=lambda a: 0.0)
    events = follower.events()
    assert texts([await anext(events) for _ in range(7)]) == [f"line {i}" for i in range(6)]
    mark = follower.mark()
    assert not follower.saw_line_count(6, mark)  # as long as what was read: nothing new
    assert not follower.saw_line_count(None, mark)  # unknown
    log.lines[:] = ["new 0"]
    pending = asyncio.ensure_future(anext(events))
    await asyncio.sleep(0.01)
    assert follower.saw_line_count(1, mark)  # shorter than what had been read: started over
    async with asyncio.timeout(budget.left()):
        assert await pending == LogRestarted()
        assert [await anext(events) for _ in range(2)] == [Connected(0), Line("new 0", 0)]
    # a count taken before that restart says nothing about the new log
    assert not follower.saw_line_count(0, mark)
    await events.aclose()


def test_backoff_is_capped_exponential_and_jitter_is_seedable() -> None:
    exact = Backoff(initial=1.0, factor=2.0, maximum=30.0)
    assert [exact.delay(i) for i in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    a = Backoff(jitter=0.2, rand=random.Random(7).random)
    b = Backoff(jitter=0.2, rand=random.Random(7).random)
    first = [a.delay(i) for i in range(8)]
    assert first == [b.delay(i) for i in range(8)]  # deterministic when seeded
    for i, d in enumerate(first):
        base = min(30.0, 2.0**i)
        assert 0.8 * base <= d <= 1.2 * base
    assert Backoff(jitter=0.2, rand=lambda: 1.0).delay(10) == pytest.approx(36.0)


def test_failures_are_one_line() -> None:
    assert (
        describe_failure(HostUnreachable("h: stream lost: reset\nmore")) == "h: stream lost: reset"
    )
    assert describe_failure(OSError("boom")) == "OSError: boom"
    assert describe_failure(TimeoutError()) == "TimeoutError"
