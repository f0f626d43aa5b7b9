"""A group (a multi-node run) in the TUI: its figures from the states of its nodes (pure).

The group's own state is `dflashctl.groups.state.group_state`, the function `dflashctl status GROUP`
uses, fed one `NodeReport` per node made from what the TUI follows of that node's host; so one
node unreachable is the group `degraded` with that node "unreachable since T", never the group
crashed, here as in the CLI.

What a group's row shows, and from where (issue 15 item 5):
- step, loss and ETA are node 0's: global rank 0 prints the run's status lines;
- Ktok/s is node 0's figure too, and that figure is the group's total: the trainer counts the
  real tokens of every rank into it (`Board.real_tokens`), so nothing is summed here (a sum
  over nodes would count each token once per node that printed it);
- a node other than node 0 prints no status lines: its step is its run-state.json `step`, and
  its silence is never "stale".
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

from dflashctl.groups.state import LIVE_NODE_STATES, GroupView, NodeReport, group_state
from dflashctl.monitor.state import STALE_AFTER_S, RunState, display_state, line_age
from dflashctl.runs.snapshot import run_finished
from trainer.events import StatusEvent

__all__ = [
    "GroupFigures",
    "group_figures",
    "node_display",
    "node_report",
    "node_step",
    "since_text",
]


def since_text(at: float, now: float) -> str:
    """`07:56Z` (UTC) within a day of `now`, `01-14 07:56Z` before."""
    fmt = "%H:%MZ" if now - at < 86400 else "%m-%d %H:%MZ"
    return time.strftime(fmt, time.gmtime(at))


def node_display(state: RunState, node_rank: int, now: float) -> str:
    """A node's one-word state (`monitor.display_state`), with "unreachable since T"; only node
    0 can be stale (the other nodes print no status lines)."""
    stale_after = STALE_AFTER_S if node_rank == 0 else math.inf
    shown = display_state(state, now, stale_after)
    if shown == "unreachable" and state.unreachable_since is not None:
        return f"unreachable since {since_text(state.unreachable_since, now)}"
    return shown


def node_step(state: RunState) -> int | None:
    """The node's step: its status line's where it prints them (node 0, the live figure), else
    its run-state.json `step`."""
    if state.status is not None:
        return state.status.step
    return state.run_info.step


def node_report(state: RunState, node_rank: int, now: float) -> NodeReport:
    """What `group_state` reads of one node, from the TUI's state of its host: a link that is
    down counts as unreachable (as the node's row says), whatever the last poll said."""
    shown = display_state(state, now, math.inf)
    return NodeReport(
        host=state.host,
        node_rank=node_rank,
        state="unreachable" if shown == "unreachable" else state.run,
        exit_status=state.exit_status,
        finished=run_finished(state.run, state.exit_status, state.run_info),
        release=state.release,
        config_hash=state.config_hash,
        step=node_step(state),
        message=state.link_error,
        run_state=state.run_info,
        pane_tail=state.pane_tail,
        last_error=state.last_error,
        supervisor=state.supervisor,
    )


@dataclass(frozen=True, slots=True)
class GroupFigures:
    """A group's row: its state (text and `GroupView`) and node 0's figures."""

    view: GroupView
    state: str
    """`running`, `degraded: b unreachable`, `failed: b rank 1`, `gave-up: b rank 1`,
    `restarting: b rank 1`, `rendezvous (1/2 nodes)`, `partial: 1/2 running`, `connecting` (a
    node not polled yet), `stale` (node 0 silent while running), ..."""
    status: StatusEvent | None
    """Node 0's last status line: the run's step, loss, Ktok/s (all ranks) and ETA."""
    step: int | None
    release: str | None
    """The nodes' release, `mixed` when they differ (start refuses such a group)."""
    line_age: float | None
    config_changed: bool


def _state_text(view: GroupView, nodes: Sequence[RunState], now: float) -> str:
    if nodes[0].measure is not None and view.state in {"stopped", "finished", "failed"}:
        return f"measuring: {nodes[0].host}"  # a group measures on node 0; its devices are busy
    if view.failed is not None:
        f = view.failed
        head = "gave-up" if view.state == "gave-up" else "failed"
        return f"{head}: {f.host}" + (f" rank {f.rank}" if f.rank is not None else "")
    if view.state in ("gave-up", "failed"):
        return view.state
    if view.state == "restarting":
        last = view.history[-1].first if view.history else None
        if last is None:
            return "restarting"
        return f"restarting: {last.host}" + (f" rank {last.rank}" if last.rank is not None else "")
    if view.state == "rendezvous":
        return f"rendezvous ({len(view.waiting)}/{len(view.nodes)} nodes)"
    if view.state == "degraded":
        return f"degraded: {', '.join(view.unreachable)} unreachable"
    if any(n.run == "unknown" for n in nodes):
        return "connecting"
    if view.state == "partial":
        live = sum(1 for r in view.nodes if r.state in LIVE_NODE_STATES)
        return f"partial: {live}/{len(view.nodes)} running"
    if view.state == "running" and node_display(nodes[0], 0, now) == "stale":
        return "stale"
    return view.state


def group_figures(name: str, nodes: Sequence[RunState], now: float) -> GroupFigures:
    """The group's figures from its nodes' states, node 0 first (pure)."""
    if not nodes:
        raise ValueError(f"group {name!r} has no nodes")
    view = group_state(name, [node_report(s, i, now) for i, s in enumerate(nodes)])
    releases = {s.release for s in nodes if s.release is not None}
    node0 = nodes[0]
    return GroupFigures(
        view=view,
        state=_state_text(view, nodes, now),
        status=node0.status,
        step=node_step(node0),
        release=releases.pop() if len(releases) == 1 else ("mixed" if releases else None),
        line_age=line_age(node0, now),
        config_changed=any(s.config_changed for s in nodes),
    )
