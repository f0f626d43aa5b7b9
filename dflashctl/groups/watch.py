"""A group in `dflashctl watch`: one event per change of the group's state, not one per node.

Its nodes are polled as hosts (their unreachable, low disk, checkpoint and GPU news stay
theirs); what their runs do is the group's, folded here from the nodes' latest statuses by
`group_state`, the rule `status GROUP` uses. A failed attempt that the group restarted after is
one RESTARTED event naming the node, rank and reason that failed first; entering gave-up or
failed is one GAVE_UP or CRASHED event with the group's summary (each attempt named), finished
is FINISHED, and running again after an alert is RECOVERED. The notify policy folds a group's
restarts into its gave-up when they fall in one burst window: a crash loop is one message.
A group first seen reports only an alert it is already in, never its history.
"""

from __future__ import annotations

from collections.abc import Mapping

from dflashctl.alerts.events import Condition, EventKind, WatchEvent
from dflashctl.config.inventory import GroupConfig
from dflashctl.groups.state import GroupPhase, NodeReport, group_state
from dflashctl.runs.snapshot import RunStatus

_ALERTS: dict[GroupPhase, tuple[EventKind, Condition]] = {
    "gave-up": (EventKind.GAVE_UP, Condition.GAVE_UP),
    "failed": (EventKind.CRASHED, Condition.CRASHED),
}


class GroupWatcher:
    """One group's watch state (a `dflashctl.alerts.watch.GroupFold`)."""

    def __init__(self, group: GroupConfig) -> None:
        self.group = group
        self._members = frozenset(group.hosts)
        self._seen = False
        self._state: GroupPhase | None = None
        self._alert: Condition | None = None
        self._restarted = 0  # failed attempts the group restarted after, already told
        self._polled: dict[str, RunStatus] = {}  # the polls the last fold read (each a new one)

    @property
    def members(self) -> frozenset[str]:
        return self._members

    def fold(self, statuses: Mapping[str, RunStatus], now: float) -> list[WatchEvent]:
        """The group's events from its nodes' latest statuses, once every node was polled again
        since the last fold (one node's news read beside another's older poll would name the
        wrong failure: the nodes' records of one attempt land moments apart)."""
        if not all(h in statuses for h in self.group.hosts):
            return []
        polled = {h: statuses[h] for h in self.group.hosts}
        if any(polled[h] is self._polled.get(h) for h in self.group.hosts):
            return []
        self._polled = polled
        view = group_state(
            self.group.name,
            [NodeReport.from_status(statuses[h], i) for i, h in enumerate(self.group.hosts)],
        )
        if view.state in ("unreachable", "degraded"):
            return []  # a lost link says nothing about the run: the nodes' own events say it
        name, first = self.group.name, not self._seen
        self._seen = True
        events: list[WatchEvent] = []
        restarted = [a for a in view.history if a.restarted]
        if not first:
            for a in restarted[self._restarted :]:
                events.append(WatchEvent(name, EventKind.RESTARTED, now, a.line(), step=view.step))
        self._restarted = len(restarted)
        if view.state != self._state:
            if view.state in _ALERTS:
                kind, cond = _ALERTS[view.state]
                if cond != self._alert:
                    events.append(WatchEvent(name, kind, now, view.summary(), cond, step=view.step))
                self._alert = cond
            elif view.state == "finished":
                if not first:
                    events.append(
                        WatchEvent(name, EventKind.FINISHED, now, view.summary(), step=view.step)
                    )
                self._alert = None
            elif view.state in ("running", "stopped") and self._alert is not None:
                events.append(
                    WatchEvent(
                        name,
                        EventKind.RECOVERED,
                        now,
                        f"{self._alert.value} cleared: now {view.state}",
                        self._alert,
                        step=view.step,
                    )
                )
                self._alert = None
            self._state = view.state
        return events
