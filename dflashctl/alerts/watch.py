"""`dflashctl watch`: poll hosts, print one line per state change, send notifications.

Headless and Textual-free (a jump host, a laptop, a systemd user unit). Each host is polled by
its own task through `RunControl.status()`, the path `dflashctl status --json` takes, and the
result goes through the same `RunStatus.to_json_dict()` into `snapshot_from_status`: the watch
reads exactly what a script reading `status --json` would. A poll that fails or hangs past the
host's `connect_timeout + command_timeout` is an unreachable snapshot for that host only; the
other hosts' tasks never wait for it.

One consumer folds whatever snapshots arrived through `notify_policy.plan_round` (ticking at
least once a second, so an outage's grace and the burst window expire on time even while a poll
hangs), prints each event's `format_event_line` (sanitised), and hands the notifications to one
daemon worker thread that sends them in order through `Notifier.send` (which retries, logs and
never raises). On stop, a pending burst window is flushed and the queue is drained for at most
`drain_s`; what is still queued then is abandoned, and `WatchOutcome` says which.

GPU health: where the container has `nvidia-smi`, each reachable poll also runs
`gpu_health.health_query_argv()`; a host without it (exit 127 / not found) is asked once. The
node's kernel log (`journalctl -k`, on the node itself, not in the container) is read for new
`NVRM: Xid` lines each such poll (`dflashctl.gpus.xids.XidReader`, the TUI's reader too): the first
read is history (no events), later reads report each Xid once (by its stamp, bus and text),
whatever the overlap of the windows read.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from dflashctl.alerts.events import (
    EventKind,
    HostSnapshot,
    WatchEvent,
    derive,
    format_event_line,
    snapshot_from_status,
)
from dflashctl.alerts.gpu_events import as_watch_events, gpu_events
from dflashctl.alerts.notify import Notifier
from dflashctl.alerts.policy import Notification, PolicyConfig, PolicyState, flush, plan
from dflashctl.config.inventory import HostConfig
from dflashctl.gpus.nvidia_smi import (
    LEGACY_REASONS_PREFIX,
    REASONS_PREFIX,
    GpuHealth,
    health_fields,
    health_query_argv,
    parse_health_csv,
    unknown_query_field,
)
from dflashctl.gpus.xid_log import Xid
from dflashctl.gpus.xid_reader import KernelLogError, XidReader
from dflashctl.remote.connect import TransportFactory
from dflashctl.remote.transport import Transport
from dflashctl.runs.snapshot import RunStatus
from trainer.events import sanitize_for_terminal

__all__ = [
    "DEFAULT_DRAIN_S",
    "DEFAULT_INTERVAL_S",
    "HostPoller",
    "NotifyWorker",
    "PollResult",
    "WatchOutcome",
    "WatchSettings",
    "run_watch",
]

log = logging.getLogger("dflashctl.alerts.watch")

DEFAULT_INTERVAL_S = 30.0
DEFAULT_DRAIN_S = 10.0
TICK_S = 1.0  # the consumer's longest sleep: grace periods and burst windows end on time
GPU_QUERY_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class WatchSettings:
    interval_s: float = DEFAULT_INTERVAL_S
    policy: PolicyConfig = field(default_factory=PolicyConfig)
    drain_s: float = DEFAULT_DRAIN_S
    gpu: bool = True


@dataclass(frozen=True)
class PollResult:
    snapshot: HostSnapshot
    gpu: tuple[WatchEvent, ...] = ()
    status: RunStatus | None = None  # the poll's status (an unreachable one too); a group's
    # watch folds its nodes' together (`GroupFold`)


class GroupFold(Protocol):
    """A group watched as one (`dflashctl.groups.watch.GroupWatcher`): its nodes' own condition
    events (crashed, restarted, gave-up, ...) are not sent; the group's are, once per change of
    the group's state, from its nodes' latest statuses together. Node-level news (unreachable,
    low disk, a checkpoint not written, GPU) stays the node's."""

    @property
    def members(self) -> frozenset[str]: ...

    def fold(self, statuses: Mapping[str, RunStatus], now: float) -> list[WatchEvent]: ...


# A group node's events that the group's own events replace (one per group state change)
GROUP_OWNED = frozenset(
    {
        EventKind.CRASHED,
        EventKind.RESTARTED,
        EventKind.STALLED,
        EventKind.GAVE_UP,
        EventKind.NONFINITE,
        EventKind.FINISHED,
    }
)


def group_owned(ev: WatchEvent, members: frozenset[str]) -> bool:
    """The event is about a group node's run (its group speaks for it), not the node itself."""
    if ev.host not in members:
        return False
    return ev.kind in GROUP_OWNED or (ev.kind == EventKind.RECOVERED and ev.condition is not None)


@dataclass(frozen=True)
class WatchOutcome:
    events: int  # printed
    queued: int  # notifications handed to the worker
    sent: int  # of those, finished (delivered or given up on by the notifier)
    abandoned: int  # still queued when the drain bound ran out

    def summary(self, drain_s: float) -> str:
        if not self.queued:
            return "stopped; no notifications were due"
        if not self.abandoned:
            return f"stopped; all {self.queued} notification(s) handed over were processed"
        return (
            f"stopped; abandoned {self.abandoned} of {self.queued} notification(s) still "
            f"queued after {drain_s:g} s"
        )


def poll_limit_s(host: HostConfig) -> float:
    """How long one status poll may take before the host counts as unreachable this round."""
    return host.connect_timeout + host.command_timeout + 5.0


class HostPoller:
    """One host: status (and GPU health) per poll over one reused transport; never raises."""

    def __init__(self, host: HostConfig, make_transport: TransportFactory, gpu: bool = True):
        self.host = host
        self._make_transport = make_transport
        self._transport: Transport | None = None
        self._gpu = gpu
        self._gpu_prefix = REASONS_PREFIX
        self._gpu_prev: dict[int, GpuHealth] | None = None
        self._gpu_said: set[str] = set()
        self._xids = XidReader()  # the node's kernel log (`dflashctl.gpus.xids`), each Xid once
        self._last_failure: str | None = None

    async def poll(self) -> PollResult:
        from dflashctl.runs.control import RunControl

        started = time.time()
        limit = poll_limit_s(self.host)
        st: RunStatus | None = None
        try:
            if self._transport is None:
                self._transport = self._make_transport(self.host)
            st = await asyncio.wait_for(RunControl(self._transport, self.host).status(), limit)
            d: Mapping[str, Any] = st.to_json_dict()
        except TimeoutError:
            d = self._unreachable(f"no status answer within {limit:g} s")
            await self._drop_transport()  # a wedged connection: start over next poll
        except Exception as err:  # one host's surprise must not end the watch
            d = self._unreachable(str(err) or type(err).__name__)
            await self._drop_transport()
        if st is None or st.state == "unreachable":
            st = RunStatus(self.host.name, "unreachable", message=str(d.get("message") or ""))
        if d.get("state") == "unreachable":
            why = sanitize_for_terminal(str(d.get("message") or "no reason given"))
            if why != self._last_failure:  # once per outage (and per new reason), not per poll
                log.info("%s: poll failed: %s", self.host.name, why)
            self._last_failure, at = why, started
        else:
            self._last_failure, at = None, time.time()
        snap = snapshot_from_status(d, at)
        gpu: tuple[WatchEvent, ...] = ()
        if snap.reachable and self._gpu:
            gpu = tuple(await self._gpu_events(snap.at))
        return PollResult(snap, gpu, st)

    def _unreachable(self, why: str) -> dict[str, Any]:
        return {"host": self.host.name, "state": "unreachable", "message": why}

    async def _gpu_events(self, at: float) -> list[WatchEvent]:
        """Events from one nvidia-smi health query; none (and no error) without nvidia-smi."""
        transport = self._transport
        if transport is None:  # only asked after a status poll answered, over this transport
            return []
        for _ in range(2):
            argv = health_query_argv(self._gpu_prefix)
            try:
                res = await transport.run(
                    argv, timeout=min(GPU_QUERY_TIMEOUT_S, self.host.command_timeout)
                )
            except Exception as err:
                self._say_once(f"{self.host.name}: GPU health query failed: {err}")
                return []
            if res.rc == 127 or "not found" in res.stderr or "No such file" in res.stderr:
                self._gpu = False  # no nvidia-smi in this container: nothing to watch there
                return []
            refused = unknown_query_field(res.stderr)
            if refused and self._gpu_prefix == REASONS_PREFIX:
                self._gpu_prefix = LEGACY_REASONS_PREFIX  # a pre-535 driver: its field names
                continue
            if not res.ok:
                self._say_once(f"{self.host.name}: nvidia-smi: {res.error_line()}")
                return []
            healths, errors = parse_health_csv(res.stdout, health_fields(self._gpu_prefix))
            for e in errors:
                self._say_once(f"{self.host.name}: {e}")
            events = gpu_events(self._gpu_prev, healths, await self._new_xids(transport))
            self._gpu_prev = {g.index: g for g in healths}
            return as_watch_events(self.host.name, at, events)
        return []

    async def _new_xids(self, transport: Transport) -> list[Xid]:
        """Xid lines in the node's kernel log not reported before ([] on the first read, and
        where the node cannot be asked or has no journalctl)."""
        try:
            read = await self._xids.read(
                transport, timeout=min(GPU_QUERY_TIMEOUT_S, self.host.command_timeout)
            )
        except KernelLogError as err:
            self._say_once(f"{self.host.name}: {err}")
            return []
        if read is None or read.history:
            return []  # the first read is history: the watch reports what happens from now
        return list(read.fresh)

    def _say_once(self, msg: str) -> None:
        if msg not in self._gpu_said:
            self._gpu_said.add(msg)
            log.warning("%s", sanitize_for_terminal(msg))

    async def _drop_transport(self) -> None:
        t, self._transport = self._transport, None
        if t is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(t.close(), 5)

    async def close(self) -> None:
        await self._drop_transport()


class NotifyWorker:
    """One daemon thread sending queued notifications in order (apprise blocks).

    A daemon thread rather than `asyncio.to_thread`: an executor thread is joined at
    interpreter exit, so a push service that hangs would hold the watch past its drain bound.
    """

    def __init__(self, notifier: Notifier) -> None:
        self._notifier = notifier
        self._queue: queue.Queue[Notification] = queue.Queue()
        self.queued = 0
        self._thread = threading.Thread(target=self._run, name="dflash-notify", daemon=True)
        self._thread.start()

    def put(self, n: Notification) -> None:
        self.queued += 1
        self._queue.put(n)

    def _run(self) -> None:
        while True:
            n = self._queue.get()
            try:
                report = self._notifier.send(n)
                log.info(
                    "notification %r: delivered to %d target(s), failed for %d",
                    n.title, len(report.delivered), len(report.failed),
                )  # fmt: skip
            except Exception:  # send never raises; the watch's worker must not die anyway
                log.exception("notification sender failed; continuing")
            finally:
                self._queue.task_done()

    def drain(self, timeout_s: float) -> int:
        """Wait up to `timeout_s` for the queue to empty; the number still unfinished."""
        q = self._queue
        with q.all_tasks_done:
            q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout=timeout_s)
            return q.unfinished_tasks


async def _poll_forever(
    poller: HostPoller, interval_s: float, out: asyncio.Queue[PollResult], stop: asyncio.Event
) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        await out.put(await poller.poll())
        left = interval_s - (time.monotonic() - t0)
        if left > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), left)


async def run_watch(
    hosts: Sequence[HostConfig],
    settings: WatchSettings,
    *,
    make_transport: TransportFactory,
    notifier: Notifier | None,
    stop: asyncio.Event,
    emit: Callable[[str], None],
    groups: Sequence[GroupFold] = (),
) -> WatchOutcome:
    """Watch until `stop` is set; print through `emit`; the outcome of the final drain.
    `groups`: groups watched as one (their nodes are among `hosts`)."""
    pollers = [HostPoller(h, make_transport, settings.gpu) for h in hosts]
    results: asyncio.Queue[PollResult] = asyncio.Queue()
    tasks = [
        asyncio.create_task(_poll_forever(p, settings.interval_s, results, stop), name=p.host.name)
        for p in pollers
    ]
    worker = NotifyWorker(notifier) if notifier is not None else None
    cfg = settings.policy
    state = PolicyState()
    printed = 0
    members = frozenset(h for g in groups for h in g.members)
    latest: dict[str, RunStatus] = {}

    def hand_over(notes: Sequence[Notification]) -> None:
        if worker is not None:
            for n in notes:
                worker.put(n)

    try:
        while not stop.is_set():
            batch: list[PollResult] = []
            with contextlib.suppress(TimeoutError):
                batch.append(await asyncio.wait_for(results.get(), TICK_S))
            while not results.empty():
                batch.append(results.get_nowait())
            now = time.time()
            watch, events = derive(
                state.watch, [r.snapshot for r in batch], now, cfg.unreachable_alert_s
            )
            events = [e for e in events if not group_owned(e, members)]
            for r in batch:
                if r.status is not None:
                    latest[r.status.host] = r.status
            events += [e for g in groups if batch for e in g.fold(latest, now)]
            state, notes = plan(
                PolicyState(watch, state.pending, state.window_opened), events, now, cfg
            )
            gpu = [e for r in batch for e in r.gpu]
            if gpu:
                state, more = plan(state, gpu, now, cfg)
                notes = [*notes, *more]
            for ev in [*events, *gpu]:
                emit(sanitize_for_terminal(format_event_line(ev)).replace("\n", " "))
                printed += 1
            hand_over(notes)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(p.close() for p in pollers), return_exceptions=True)
    if state.pending:  # a burst window still open: its events are news too
        hand_over(flush(state.pending, cfg.summarize_at))
    if worker is None:
        return WatchOutcome(printed, 0, 0, 0)
    left = await asyncio.to_thread(worker.drain, settings.drain_s)
    return WatchOutcome(printed, worker.queued, worker.queued - left, left)
