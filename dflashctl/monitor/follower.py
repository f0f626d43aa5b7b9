"""`HostFollower`: one host's `RunState` kept current, over the one follow loop and pollers.

One async task per host follows status.log through `dflashctl.runs.follow.LogFollower` (typed
events, one backoff) and polls `status()` and `gpus()` (with GPU health where the control
reports it, and the node's kernel log for Xids where its transport can run commands on the
node: the first read is history, later Xids are news). It never touches widgets; it publishes
each new `RunState` through a callback, and the app coalesces those into a few redraws a second.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from dflashctl.gpus.nvidia_smi import GpuHealth, GpuSample
from dflashctl.gpus.xid_reader import XidReader
from dflashctl.monitor.state import (
    LOG_TAIL,
    RunState,
    StatusView,
    apply_line,
    apply_link,
    apply_status,
    apply_xids,
    mark_reachability,
    start_new_run,
)
from dflashctl.remote.transport import Transport
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
)

if TYPE_CHECKING:
    pass


class FollowedHost(LogSource, Protocol):
    """The slice of `dflashctl.runs.service.RunService` the follower uses."""

    async def status(self) -> StatusView: ...

    async def gpus(self) -> Sequence[GpuSample]: ...


@runtime_checkable
class HealthSource(Protocol):
    """A control that also reports GPU health (ECC counts, clock-event reasons) through
    `dflashctl.gpus.health`'s query and parser; the follower polls it beside `gpus()`."""

    async def gpu_health(self) -> Sequence[GpuHealth]: ...


@runtime_checkable
class OverTransport(Protocol):
    """A control that runs over a transport (`RunControl`): where that transport can also run
    commands on the node (`NodeCommands`), the follower reads the node's kernel log for Xids."""

    @property
    def transport(self) -> Transport: ...


@dataclass
class HostFollower:
    """Keeps one host's `RunState` current over a `FollowedHost`; isolates that host's failures.

    The stream is the one follow loop (`dflashctl.runs.follow.LogFollower`, which owns the read
    position): any failure is a lost link, retried after `backoff` so the UI can show
    "retry in Ns", and `reconnect_now` connects again at once. The status and GPU pollers run
    beside it. `publish` is called with every new state and must be cheap: the app stores it
    and marks the host dirty.
    """

    host: str
    control: FollowedHost
    publish: Callable[[RunState], None]
    clock: Callable[[], float] = time.time
    backoff: Backoff = field(default_factory=Backoff)
    status_every: float = 5.0
    gpu_every: float = 10.0
    call_timeout: float = 20.0
    state: RunState = field(init=False)
    _log: LogFollower | None = field(init=False, default=None)
    _xids: XidReader = field(init=False, default_factory=XidReader)
    """The node's kernel log (`dflashctl.gpus.xids`, the watch's reader too): each Xid once."""

    def __post_init__(self) -> None:
        self.state = RunState(host=self.host)

    def _set(self, state: RunState) -> None:
        state = mark_reachability(state, self.clock())
        self.state = state
        self.publish(state)

    def reconnect_now(self) -> None:
        """Drop the current stream (and any backoff wait) and follow again immediately."""
        if self._log is not None:
            self._log.reconnect_now()

    def mark_config(self, changed: bool, note: str | None = None) -> None:
        self._set(replace(self.state, config_changed=changed, config_note=note))

    def new_run(self) -> None:
        """A fresh run started: its curves must not continue the old run's."""
        self._set(start_new_run(self.state))

    def reset_stream(self) -> None:
        """Forget what was read: after a fresh restart status.log starts over."""
        self._set(replace(self.state, lines_seen=0))
        if self._log is not None:
            self._log.restart()

    async def poll_status(self) -> None:
        """One status poll; failures mark the host unreachable instead of raising."""
        mark = self._log.mark() if self._log is not None else None
        try:
            status = await asyncio.wait_for(self.control.status(), self.call_timeout)
        except Exception as exc:  # any failure of one host is that host's state, not a crash
            self._set(replace(self.state, run="unreachable", link_error=describe_failure(exc)))
            return
        self._set(apply_status(self.state, status))
        reachable = self.state.run not in {"unreachable", "unknown"}
        if reachable and mark is not None and self._log is not None:
            log_lines = status.log_lines
            if isinstance(log_lines, int) and log_lines >= 0:  # shrank: a fresh run started it
                self._log.saw_line_count(log_lines, mark)

    async def _skip_to_what_is_shown(self) -> None:
        """Start the first follow LOG_TAIL lines before the end of status.log, not at line 1.

        The panes keep at most LOG_TAIL lines (and HISTORY <= LOG_TAIL points), so replaying a
        days-long log from its first line costs a full transfer and parse for nothing.
        """
        if self.state.lines_seen:
            return
        try:  # only the line count; the status poller publishes what it finds
            status = await asyncio.wait_for(self.control.status(), self.call_timeout)
        except Exception:  # an unreachable host: the follow and the poller will say so
            return
        total = status.log_lines
        if isinstance(total, int) and total > LOG_TAIL and not self.state.lines_seen:
            self._set(replace(self.state, lines_seen=total - LOG_TAIL))

    async def poll_gpus(self) -> None:
        with contextlib.suppress(Exception):
            gpus = await asyncio.wait_for(self.control.gpus(), self.call_timeout)
            self._set(replace(self.state, gpus=tuple(gpus)))
        control = self.control
        if self.state.gpus and isinstance(control, HealthSource):  # asked only with GPUs
            with contextlib.suppress(Exception):
                health = await asyncio.wait_for(control.gpu_health(), self.call_timeout)
                self._set(replace(self.state, gpu_health=tuple(health)))
        if self.state.gpus:
            with contextlib.suppress(Exception):
                await self.poll_xids()

    async def poll_xids(self) -> None:
        """One read of the node's kernel log: the first read's Xids are history, later reads
        add each Xid not in the read before (the windows overlap) as news."""
        transport = self.control.transport if isinstance(self.control, OverTransport) else None
        if transport is None:
            return
        read = await self._xids.read(transport, self.call_timeout)
        if read is not None and read.fresh:
            self._set(apply_xids(self.state, read.fresh, self.clock(), history=read.history))

    async def _on_event(self, event: FollowEvent) -> None:
        state = self.state
        if isinstance(event, Line):
            if state.link != "live":
                state = apply_link(state, "live")
            state = apply_line(state, event.text, self.clock())
            self._set(replace(state, lines_seen=event.number + 1))
        elif isinstance(event, Connected):
            self._set(apply_link(state, "connecting"))
            if state.link == "retrying":  # back after a wait: say what the run did meanwhile
                await self.poll_status()
        elif isinstance(event, Lost):
            retry_at = self.clock() + event.retry_in
            self._set(apply_link(state, "retrying", event.reason, retry_at))
        elif isinstance(event, LogRestarted):  # status.log is read again from its first line
            self._set(replace(state, lines_seen=0))

    async def _poll_loop(self, every: float, poll: Callable[[], Awaitable[None]]) -> None:
        while True:
            await poll()
            await asyncio.sleep(every)

    async def run(self) -> None:
        """Follow forever (until cancelled): the follow loop's events fold into the state."""
        await self._skip_to_what_is_shown()
        log = LogFollower(
            self.control,
            self.state.lines_seen,
            delay=self.backoff.delay,
            retryable=any_failure,
            name=self.host,
        )
        self._log = log
        pollers = [
            asyncio.create_task(self._poll_loop(self.status_every, self.poll_status)),
            asyncio.create_task(self._poll_loop(self.gpu_every, self.poll_gpus)),
        ]
        try:
            async for event in log.events():
                await self._on_event(event)
        finally:
            self._log = None
            for task in pollers:
                task.cancel()
            await asyncio.gather(*pollers, return_exceptions=True)


if TYPE_CHECKING:
    from dflashctl.runs.control import RunControl
    from dflashctl.runs.service import RunService

    def _slices(service: RunService, control: RunControl) -> tuple[FollowedHost, FollowedHost]:
        return service, control  # both serve a follower (checked by mypy)
