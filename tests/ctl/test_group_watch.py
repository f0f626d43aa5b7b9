"""A group in `dflashctl watch`: one event per change of the group's state from its nodes'
statuses together (`dflashctl.groups.watch.GroupWatcher`), its nodes' own run events dropped,
and a crash loop's restarts folded into its gave-up: one notification (pure)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflashctl.alerts.events import EventKind, WatchEvent
from dflashctl.alerts.policy import flush
from dflashctl.alerts.watch import group_owned
from dflashctl.config.inventory import parse_inventory
from dflashctl.groups.watch import GroupWatcher
from dflashctl.runs.snapshot import RunStatus
from trainer.events.run_state import RunState

WHY = "rank 1: stage drafter failed: InjectedFault: injected fault"


def status(host: str, rank: int, state: str, sup: dict[str, Any]) -> RunStatus:
    return RunStatus(
        host=host,
        state=state,
        run_state=RunState(rank_range=[rank, rank + 1]),
        supervisor={"state": state, "attempt": 1, "failures": [], "restarts": [], **sup},
    )


def failure(attempt: int) -> dict[str, Any]:
    at = f"2026-12-01T10:0{attempt}:00Z"
    rec = {"attempt": attempt, "kind": "rank", "node_rank": 1, "rank": 1, "reason": "exit 1"}
    return {**rec, "at": at, "error": WHY, "peer": False}


def test_a_crash_loop_is_one_event_per_group_change_and_one_notification(tmp_path: Path) -> None:
    text = ""
    for i in range(2):
        text += f'[hosts.n{i}]\naddress = "p{i}"\nctid = {200 + i}\nnode_address = "10.0.0.{i}"\n'
    group = parse_inventory(text + '[groups.g]\nhosts = ["n0", "n1"]\n', tmp_path / "h.toml")
    w = GroupWatcher(group.groups["g"])
    assert w.members == frozenset({"n0", "n1"})
    run = {"n0": status("n0", 0, "running", {}), "n1": status("n1", 1, "running", {})}
    assert w.fold({"n0": run["n0"]}, 1.0) == []  # not every node polled yet
    assert w.fold(run, 2.0) == []  # first seen, running: no history told
    one = [failure(1)]
    restarts = [{"attempt": 2, "resumed_at": "x"}]
    back = {
        "n0": status("n0", 0, "running", {"attempt": 2}),
        "n1": status("n1", 1, "running", {"attempt": 2, "failures": one, "restarts": restarts}),
    }
    (ev,) = w.fold(back, 3.0)
    assert (ev.host, ev.kind) == ("g", EventKind.RESTARTED)
    assert ev.detail == f"attempt 1: node 1 (n1) rank 1: exit 1: {WHY}"
    assert w.fold(back, 4.0) == []  # nothing changed: nothing said
    gave = "gave up after 1 group restarts: node 1 rank 1: exit 1, node 1 rank 1: exit 1"
    two = [failure(1), failure(2)]
    ended = {
        "n0": status("n0", 0, "rendezvous", {"attempt": 2}),
        "n1": status(
            "n1",
            1,
            "gave-up",
            {"attempt": 2, "failures": two, "restarts": restarts, "detail": gave},
        ),
    }
    (g,) = w.fold(ended, 5.0)
    assert g.kind == EventKind.GAVE_UP and g.detail.startswith(f"g: gave-up: {gave}; attempt 1")
    assert "attempt 2: node 1 (n1) rank 1: exit 1" in g.detail
    assert w.fold(ended, 6.0) == []
    notes = flush([ev, g])
    assert len(notes) == 1 and notes[0].severity == "failure", notes  # the restart folded in
    assert "attempt 1" in notes[0].body and "gave up" in notes[0].body


def test_a_group_nodes_run_events_are_the_groups_and_its_link_events_its_own() -> None:
    members = frozenset({"n0", "n1"})
    assert group_owned(WatchEvent("n1", EventKind.CRASHED, 0.0), members)
    assert group_owned(WatchEvent("n1", EventKind.RESTARTED, 0.0), members)
    assert not group_owned(WatchEvent("n1", EventKind.UNREACHABLE, 0.0), members)
    assert not group_owned(WatchEvent("n1", EventKind.RECOVERED, 0.0, since=1.0), members)
    assert not group_owned(WatchEvent("n1", EventKind.LOW_DISK, 0.0), members)
    assert not group_owned(WatchEvent("other", EventKind.CRASHED, 0.0), members)


def test_the_group_is_judged_only_on_every_nodes_new_poll(tmp_path: Path) -> None:
    """Node 0 gave up (its torchrun spent its restarts after its rank lost its peer) in a poll
    newer than node 1's: nothing is said until node 1 is polled again, and then the attempt's
    cause is node 1's own rank, not node 0's agent that only followed it."""
    text = ""
    for i in range(2):
        text += f'[hosts.n{i}]\naddress = "p{i}"\nctid = {200 + i}\nnode_address = "10.0.0.{i}"\n'
    group = parse_inventory(text + '[groups.g]\nhosts = ["n0", "n1"]\n', tmp_path / "h.toml")
    w = GroupWatcher(group.groups["g"])
    stale1 = status("n1", 1, "running", {})
    assert w.fold({"n0": status("n0", 0, "running", {}), "n1": stale1}, 1.0) == []
    spent = {"attempt": 1, "kind": "agent", "node_rank": 0, "rank": None}
    spent |= {"reason": "torchrun spent its --max-restarts", "at": "2026-12-01T10:00:05Z"}
    peer = failure(1) | {"node_rank": 0, "rank": 0, "peer": True}
    gave0 = status("n0", 0, "gave-up", {"failures": [peer, spent], "detail": "gave up ..."})
    assert w.fold({"n0": gave0, "n1": stale1}, 2.0) == []  # node 1's poll is the old one
    own = failure(1) | {"at": "2026-12-01T10:00:09Z"}  # recorded later than node 0's, even
    (ev,) = w.fold({"n0": gave0, "n1": status("n1", 1, "gave-up", {"failures": [own]})}, 3.0)
    assert ev.kind == EventKind.GAVE_UP
    assert "attempt 1: node 1 (n1) rank 1: exit 1" in ev.detail, ev.detail
