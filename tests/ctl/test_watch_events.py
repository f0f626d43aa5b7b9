"""Watch event derivation: table tests and properties (pure, no parts needed)."""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from dflashctl.alerts.events import (
    ALERT_CONDITIONS,
    Condition,
    EventKind,
    HostSnapshot,
    Restart,
    WatchState,
    derive,
    format_event_line,
    snapshot_from_status,
)

T0 = 1_800_000_000.0
C = Condition
K = EventKind


def up(host: str, at: float, cond: Condition, *, restarts: int = 0, **kw: Any) -> HostSnapshot:
    rs = tuple(Restart(T0 + i, f"exit {i + 1}", i + 1, 10 * i) for i in range(restarts))
    return HostSnapshot(host, at, True, cond, restarts=rs, **kw)


def down(host: str, at: float) -> HostSnapshot:
    return HostSnapshot(host, at, False)


def run(snaps: list[HostSnapshot], alert_s: float = 300.0) -> list[tuple[str, EventKind]]:
    state, out = WatchState(), []
    for s in snaps:
        state, evs = derive(state, [s], s.at, alert_s)
        out += [(e.host, e.kind) for e in evs]
    return out


def test_unreachable_is_never_crashed_and_alerts_once_after_the_grace() -> None:
    snaps = [up("a", T0, C.RUNNING)] + [down("a", T0 + 60 * i) for i in range(1, 12)]
    snaps.append(up("a", T0 + 800, C.RUNNING, step=500))
    assert run(snaps) == [("a", K.UNREACHABLE), ("a", K.RECOVERED)]


def test_a_short_outage_emits_nothing() -> None:
    snaps = [up("a", T0, C.RUNNING), down("a", T0 + 10), down("a", T0 + 200)]
    assert run([*snaps, up("a", T0 + 250, C.RUNNING)]) == []


def test_unreachable_alert_fires_on_time_even_without_a_new_poll() -> None:
    state, _ = derive(WatchState(), [up("a", T0, C.RUNNING)], T0)
    state, evs = derive(state, [down("a", T0 + 5)], T0 + 5)
    assert evs == []
    state, evs = derive(state, [], T0 + 400)  # the next poll of "a" hangs
    assert [(e.kind, e.since) for e in evs] == [(K.UNREACHABLE, T0 + 5)]
    assert "unreachable since" in format_event_line(evs[0])
    _, evs = derive(state, [], T0 + 900)
    assert evs == []


def test_crash_restart_recover_table() -> None:
    snaps = [
        up("a", T0, C.RUNNING),
        up("a", T0 + 1, C.CRASHED, exit_status=1),
        up("a", T0 + 2, C.CRASHED, exit_status=1),  # same state: nothing new
        up("a", T0 + 3, C.RESTARTING, restarts=1),
        up("a", T0 + 4, C.RUNNING, restarts=1),
        up("a", T0 + 5, C.RUNNING, restarts=1),
        up("a", T0 + 6, C.FINISHED, restarts=1),
    ]
    assert run(snaps) == [
        ("a", K.CRASHED),
        ("a", K.RESTARTED),
        ("a", K.RECOVERED),
        ("a", K.FINISHED),
    ]


def test_stall_then_gave_up_then_operator_stop() -> None:
    snaps = [
        up("a", T0, C.RUNNING),
        up("a", T0 + 1, C.STALLED),
        up("a", T0 + 2, C.RESTARTING, restarts=1),
        up("a", T0 + 3, C.RESTARTING, restarts=2),
        up("a", T0 + 4, C.GAVE_UP, restarts=3),
        up("a", T0 + 5, C.STOPPED, restarts=3),
    ]
    assert run(snaps) == [
        ("a", K.STALLED),
        ("a", K.RESTARTED),
        ("a", K.RESTARTED),
        ("a", K.RESTARTED),
        ("a", K.GAVE_UP),
        ("a", K.RECOVERED),
    ]


def test_restarted_carries_the_reason_and_a_fresh_run_rebaselines() -> None:
    state, _ = derive(WatchState(), [up("a", T0, C.RUNNING)], T0)
    rs = (Restart(T0 + 1, "signal 9", -9, 1200),)
    state, evs = derive(state, [HostSnapshot("a", T0 + 2, True, C.RUNNING, restarts=rs)], T0 + 2)
    assert [e.detail for e in evs] == ["signal 9 (resumed from step 1200)"]
    state, evs = derive(state, [up("a", T0 + 3, C.RUNNING)], T0 + 3)  # fresh run: empty list
    assert evs == []


def test_first_sight_reports_a_current_alert_but_no_history() -> None:
    assert run([up("a", T0, C.CRASHED, restarts=2, exit_status=1)]) == [("a", K.CRASHED)]
    assert run([up("b", T0, C.FINISHED, restarts=2)]) == []
    assert run([up("c", T0, C.RUNNING, restarts=2)]) == []


def test_nonfinite_and_hosts_are_independent() -> None:
    snaps = [
        up("a", T0, C.RUNNING),
        up("b", T0, C.RUNNING),
        up("a", T0 + 1, C.NONFINITE),
        down("b", T0 + 1),
        down("b", T0 + 400),
    ]
    assert run(snaps) == [("a", K.NONFINITE), ("b", K.UNREACHABLE)]


def test_snapshot_from_status_json() -> None:
    s = snapshot_from_status({"host": "a", "state": "unreachable", "message": "x"}, T0)
    assert not s.reachable and s.condition is None
    fin = {"host": "a", "state": "stopped", "exit_status": 0, "finished": True}
    assert snapshot_from_status(fin, T0).condition == C.FINISHED
    nf = {
        "host": "a",
        "state": "crashed",
        "exit_status": 1,
        "last_error": "3 non-finite losses in a row (step 9)",
    }
    assert snapshot_from_status(nf, T0).condition == C.NONFINITE
    gu = {"host": "a", "state": "crashed", "supervisor": {"gave_up": True}}
    assert snapshot_from_status(gu, T0).condition == C.GAVE_UP
    rs = {
        "host": "a",
        "state": "running",
        "step": 7,
        "restarts": [{"at": T0, "reason": "exit 1", "exit_status": 1, "resumed_step": 5}],
    }
    snap = snapshot_from_status(rs, T0)
    assert snap.restarts == (Restart(T0, "exit 1", 1, 5),) and snap.step == 7
    assert snapshot_from_status({"host": "a", "state": "stopped"}, T0).condition == C.STOPPED


def test_snapshot_from_status_with_the_supervisor() -> None:
    """The pane runs the supervisor, so "running" + supervisor "restarting" is restarting."""
    sup = {
        "state": "restarting",
        "gave_up": False,
        "restarts": [{"at": "2027-01-15T08:00:05Z", "attempt": 2, "reason": "signal 9",
                      "exit_status": -9, "signal": "SIGKILL", "checkpoint_step": 40,
                      "resumed_step": None, "backoff_s": 10}],
    }  # fmt: skip
    snap = snapshot_from_status({"host": "a", "state": "running", "supervisor": sup}, T0)
    assert snap.condition == C.RESTARTING
    assert snap.restarts == (Restart(T0 + 5, "signal 9", -9, None, 40),)
    state, _ = derive(WatchState(), [up("a", T0, C.RUNNING)], T0)
    _, evs = derive(state, [snap], T0)
    assert [e.detail for e in evs] == ["signal 9 (newest checkpoint: step 40)"]
    stalled = {"host": "a", "state": "running", "supervisor": {"state": "stalled"}}
    assert snapshot_from_status(stalled, T0).condition == C.STALLED
    calm = {"host": "a", "state": "running", "supervisor": {"state": "running"}}
    assert snapshot_from_status(calm, T0).condition == C.RUNNING
    gave = {"host": "a", "state": "stopped", "exit_status": 1, "supervisor": {"state": "gave-up"}}
    assert snapshot_from_status(gave, T0).condition == C.GAVE_UP
    # the supervisor's account leads the alert's detail, the trainer's last error follows
    told = {**gave, "last_error": "stage drafter failed: X"}
    told["supervisor"] = {"state": "gave-up", "detail": "gave up after 2 restarts in 9 s: exit 1"}
    assert snapshot_from_status(told, T0).detail == (
        "gave up after 2 restarts in 9 s: exit 1; last error: stage drafter failed: X"
    )
    stall = {"state": "stalled", "detail": "no progress for 12 s (limit 10 s)"}
    assert snapshot_from_status(
        {"host": "a", "state": "running", "supervisor": stall}, T0
    ).detail == ("no progress for 12 s (limit 10 s)")


def test_low_disk_is_one_event_per_change_and_no_condition() -> None:
    low = "0.5 MiB free on the run directory, checkpoint needs 1.0"
    snaps = [
        up("a", T0, C.RUNNING),
        up("a", T0 + 1, C.RUNNING, low_disk=low),
        up("a", T0 + 2, C.RUNNING, low_disk=low),  # still low: nothing new
        down("a", T0 + 3),  # unreachable says nothing about the disk
        up("a", T0 + 4, C.RUNNING, low_disk=low),
        up("a", T0 + 5, C.CRASHED, exit_status=1, low_disk=low),  # the crash is its own alert
        up("a", T0 + 6, C.RUNNING),
    ]
    assert run(snaps) == [
        ("a", K.LOW_DISK),
        ("a", K.CRASHED),
        ("a", K.RECOVERED),
        ("a", K.RECOVERED),
    ]
    sup = {"state": "running", "low_disk": {"free_mib": 0.5, "needed_mib": 1.0, "since": "x"}}
    snap = snapshot_from_status({"host": "a", "state": "running", "supervisor": sup}, T0)
    assert snap.condition == C.RUNNING and snap.low_disk == low
    _, evs = derive(WatchState(), [snap], T0)  # already low at watch start: news
    assert [(e.kind, e.detail) for e in evs] == [(K.LOW_DISK, low)]
    assert format_event_line(evs[0]).endswith(f"a low-disk: {low}")
    cleared = {
        "host": "a",
        "state": "running",
        "supervisor": {"state": "running", "low_disk": None},
    }
    assert snapshot_from_status(cleared, T0).low_disk is None
    # a supervisor that words it (trainer.supervision.filesystems): its words, as they are
    worded = {
        "free_mib": 1.5,
        "needed_mib": 2.0,
        "path": "/w/run/checkpoints",
        "text": "1.5 MiB free on /w/run/checkpoints, checkpoints need 2.0 MiB: the newest "
        "checkpoint (1.0 MiB) x 3 checkpoints on disk at the peak of a write",
        "consequence": "a later checkpoint will fail",
    }
    retained = {
        "host": "a",
        "state": "running",
        "supervisor": {"state": "running", "low_disk": worded},
    }
    assert snapshot_from_status(retained, T0).low_disk == (
        f"{worded['text']}; a later checkpoint will fail"
    )


def test_a_failed_checkpoint_is_one_event_per_step_and_recovers_when_one_is_written() -> None:
    def polled(at: float, failed: int | None, step: int) -> HostSnapshot:
        ck = {"step": failed, "directory": "/w/run/checkpoints", "reason": "No space left"}
        d = {"host": "a", "state": "running", "step": step, "checkpoint_failed": ck}
        return snapshot_from_status(
            d if failed is not None else {**d, "checkpoint_failed": None}, at
        )

    snaps = [
        polled(T0, None, 5),
        polled(T0 + 1, 10, 11),
        polled(T0 + 2, 10, 13),  # the same failure: nothing new
        down("a", T0 + 3),
        polled(T0 + 4, 15, 16),  # the next one failed too
        polled(T0 + 5, None, 21),  # step 20's was written
    ]
    _, evs = derive(WatchState(), snaps, T0 + 5)
    assert [(e.kind, e.detail) for e in evs] == [
        (
            K.CHECKPOINT_FAILED,
            "checkpoint step 10 not written to /w/run/checkpoints: No space left",
        ),
        (
            K.CHECKPOINT_FAILED,
            "checkpoint step 15 not written to /w/run/checkpoints: No space left",
        ),
        (K.RECOVERED, "checkpoints written again"),
    ]
    # already failing when the watch starts: news, like an alert it is in
    _, first = derive(WatchState(), [polled(T0, 10, 11)], T0)
    assert [e.kind for e in first] == [K.CHECKPOINT_FAILED]


# --- properties ------------------------------------------------------------------------------

_conds = st.sampled_from(list(Condition))
_snap = st.one_of(
    st.tuples(st.just("down"), st.integers(0, 400)),
    st.tuples(_conds, st.integers(0, 400), st.integers(0, 3)),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.sampled_from("ab"), _snap), max_size=40))
def test_events_only_on_changes_and_recovered_only_after_an_alert(
    seq: list[tuple[str, tuple[Any, ...]]],
) -> None:
    state, t = WatchState(), T0
    open_alerts: dict[str, set[str]] = {"a": set(), "b": set()}
    prev: dict[str, tuple[object, ...]] = {}
    restarts: dict[str, int] = {"a": 0, "b": 0}
    for host, item in seq:
        if item[0] == "down":
            t += item[1]
            snap = down(host, t)
            key: tuple[object, ...] = ("down",)
        else:
            cond, dt, add = item
            t += dt
            restarts[host] += add
            snap = up(host, t, cond, restarts=restarts[host])
            key = (cond,)
        state, evs = derive(state, [snap], t, 300.0)
        # another host's event can only be its outage passing the grace (time-driven)
        assert all(e.kind == K.UNREACHABLE for e in evs if e.host != host)
        mine = [e for e in evs if e.host == host]
        if prev.get(host) == key and key != ("down",):
            # same reachable condition again: at most the new restarts, nothing else
            assert [e for e in mine if e.kind != K.RESTARTED] == []
        if key != ("down",):
            assert len([e for e in mine if e.kind == K.RESTARTED]) <= item[2]
        # one poll: at most one condition event, plus at most the end of an outage
        back = [e for e in mine if e.kind == K.RECOVERED and e.condition is None]
        assert len(back) <= 1
        assert len([e for e in mine if e.kind != K.RESTARTED and e not in back]) <= 1
        for e in evs:
            alerts = open_alerts[e.host]
            if e.kind == K.UNREACHABLE:
                assert "unreachable" not in alerts  # once per outage
                alerts.add("unreachable")
            elif e.kind == K.RECOVERED:
                what = "unreachable" if e.condition is None else e.condition.value
                assert what in alerts, (what, alerts)  # recovered only follows an alert
                alerts.discard(what)
            elif e.kind in {K.CRASHED, K.STALLED, K.GAVE_UP, K.NONFINITE}:
                assert e.host == host and snap.reachable  # never crashed while unreachable
                assert e.condition in ALERT_CONDITIONS
                assert e.condition.value not in alerts  # once per state change
                alerts.intersection_update({"unreachable"})
                alerts.add(e.condition.value)
            elif e.kind == K.FINISHED:
                alerts.intersection_update({"unreachable"})
        prev[host] = key


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=8,
)
_keys = st.sampled_from(
    [
        "host",
        "state",
        "step",
        "exit_status",
        "finished",
        "last_error",
        "message",
        "supervisor",
        "restarts",
    ]
)


@settings(max_examples=300, deadline=None)
@given(
    st.dictionaries(
        _keys, _json | st.sampled_from(["running", "crashed", "unreachable", "gave-up"])
    ),
    st.dictionaries(st.sampled_from(["state", "gave_up", "restarts"]), _json, max_size=3),
)
def test_snapshot_from_status_never_raises_on_any_json(
    d: dict[str, Any], sup: dict[str, Any]
) -> None:
    """A host with a strange status dict must not stop the watch of the others."""
    d = dict(d)
    if sup:
        d["supervisor"] = sup
    snap = snapshot_from_status(d, T0)
    assert snap.reachable == (d.get("state") != "unreachable")
    if snap.reachable:
        assert isinstance(snap.condition, Condition)
