"""What `dflashctl watch` notifies, and when: a pure function of (state, new polls, time).

`plan_round(state, snapshots, now, cfg)` folds one round of polls through
`watch_events.derive` (so each event exists once per state change) and holds the events for
`burst_s` from the first one: what is pending then is flushed as notifications, one per event,
except that an event kind reached by `summarize_at` or more hosts in one window becomes one
summary ("unreachable: 5 hosts"), and a host's restarts in the window of its gave-up are folded
into that one message (the gave-up names each attempt's exit status already: a crash loop is
one notification, not one per restart and one more). Sending is `dflashctl.alerts.notify`'s job;
nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from dflashctl.alerts.events import (
    EventKind,
    HostSnapshot,
    WatchEvent,
    WatchState,
    derive,
    format_event_line,
)

__all__ = ["Notification", "PolicyConfig", "PolicyState", "flush", "plan", "plan_round"]

# apprise's NotifyType values, worst first
_SEVERITY: dict[EventKind, str] = {
    EventKind.CRASHED: "failure",
    EventKind.STALLED: "failure",
    EventKind.GAVE_UP: "failure",
    EventKind.NONFINITE: "failure",
    EventKind.UNREACHABLE: "warning",
    EventKind.RESTARTED: "warning",
    EventKind.LOW_DISK: "warning",
    EventKind.CHECKPOINT_FAILED: "failure",  # training goes on that cannot be kept
    EventKind.FINISHED: "success",
    EventKind.RECOVERED: "success",
    EventKind.GPU_ERROR: "failure",
    EventKind.GPU_THROTTLED: "warning",
    EventKind.GPU_CLEARED: "success",
    EventKind.REGEN_FINISHED: "success",
    EventKind.REGEN_FAILED: "failure",
}
MAX_LISTED = 20


@dataclass(frozen=True)
class PolicyConfig:
    unreachable_alert_s: float = 300.0
    burst_s: float = 30.0  # events are gathered this long from the first one, then sent
    summarize_at: int = 3  # this many hosts with one event kind in a window: one message


@dataclass(frozen=True)
class PolicyState:
    watch: WatchState = field(default_factory=WatchState)
    pending: tuple[WatchEvent, ...] = ()
    window_opened: float | None = None


@dataclass(frozen=True)
class Notification:
    title: str
    body: str
    severity: str  # apprise NotifyType: failure | warning | success | info
    events: tuple[WatchEvent, ...]


def plan_round(
    state: PolicyState, snapshots: Iterable[HostSnapshot], now: float, cfg: PolicyConfig
) -> tuple[PolicyState, list[WatchEvent], list[Notification]]:
    """One poll round: the new state, the events (for stdout), the notifications due now."""
    watch, events = derive(state.watch, snapshots, now, cfg.unreachable_alert_s)
    new, notes = plan(PolicyState(watch, state.pending, state.window_opened), events, now, cfg)
    return new, events, notes


def plan(
    state: PolicyState, events: Iterable[WatchEvent], now: float, cfg: PolicyConfig
) -> tuple[PolicyState, list[Notification]]:
    """Add events to the window; flush it once `burst_s` has passed since it opened."""
    pending = state.pending + tuple(events)
    opened = state.window_opened
    if pending and opened is None:
        opened = now
    if not pending or opened is None or now - opened < cfg.burst_s:
        return PolicyState(state.watch, pending, opened if pending else None), []
    return PolicyState(state.watch, (), None), flush(pending, cfg.summarize_at)


def flush(events: Iterable[WatchEvent], summarize_at: int = 3) -> list[Notification]:
    """Notifications for one window's events, in the order of each group's first event.

    A kind that `summarize_at` or more hosts reached is one fleet summary; otherwise one host's
    repeats of a kind (three restarts in a window) are one host summary; the rest go singly. A
    host that gave up in the window has its restarts of the window folded into its gave-up
    message (listed first in its body and events; the message takes the first one's place).
    """
    evs = sorted(events, key=lambda e: e.at)
    gave_up = {ev.host for ev in evs if ev.kind == EventKind.GAVE_UP}

    def kind_of(ev: WatchEvent) -> EventKind:
        folded = ev.kind == EventKind.RESTARTED and ev.host in gave_up
        return EventKind.GAVE_UP if folded else ev.kind

    hosts_of: dict[EventKind, set[str]] = {}
    for ev in evs:
        hosts_of.setdefault(kind_of(ev), set()).add(ev.host)
    groups: dict[tuple[EventKind, str | None], list[WatchEvent]] = {}
    for ev in evs:
        kind = kind_of(ev)
        fleet = len(hosts_of[kind]) >= summarize_at
        groups.setdefault((kind, None if fleet else ev.host), []).append(ev)
    out: list[Notification] = []
    for (kind, host), group in groups.items():  # dicts keep first-insertion order
        main = [e for e in group if e.kind == kind]
        if host is None:
            out.append(_summary(kind, main, group))
        elif len(main) == 1:
            out.append(_single(main[0], group))
        else:
            out.append(_repeats(host, kind, main, group))
    return out


def _body(evs: list[WatchEvent]) -> str:
    lines = [format_event_line(e) for e in evs[:MAX_LISTED]]
    if len(evs) > MAX_LISTED:
        lines.append(f"... and {len(evs) - MAX_LISTED} more")
    return "\n".join(lines)


def _single(ev: WatchEvent, group: list[WatchEvent]) -> Notification:
    """One event; `group` is it plus the restarts folded into it (a gave-up's)."""
    title = f"dflash {ev.host}: {_kind_text(ev)}"
    return Notification(title, _body(group), _SEVERITY[ev.kind], tuple(group))


def _repeats(
    host: str, kind: EventKind, evs: list[WatchEvent], group: list[WatchEvent]
) -> Notification:
    title = f"dflash {host}: {kind.value} {len(evs)} times"
    return Notification(title, _body(group), _SEVERITY[kind], tuple(group))


def _summary(kind: EventKind, evs: list[WatchEvent], group: list[WatchEvent]) -> Notification:
    hosts = list(dict.fromkeys(e.host for e in evs))
    listed = ", ".join(hosts[:MAX_LISTED]) + (
        f" +{len(hosts) - MAX_LISTED} more" if len(hosts) > MAX_LISTED else ""
    )
    title = f"dflash: {len(hosts)} hosts {kind.value} ({listed})"
    return Notification(title, _body(group), _SEVERITY[kind], tuple(group))


def _kind_text(ev: WatchEvent) -> str:
    if ev.kind == EventKind.RECOVERED:
        return f"recovered ({ev.condition.value if ev.condition else 'unreachable'})"
    return ev.kind.value
