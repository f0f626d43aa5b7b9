"""The notify policy: what is sent when (pure; table tests and a property)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from dflashctl.alerts.events import Condition, EventKind, HostSnapshot, WatchEvent
from dflashctl.alerts.policy import (
    Notification,
    PolicyConfig,
    PolicyState,
    flush,
    plan,
    plan_round,
)

T0 = 1_800_000_000.0
K = EventKind


def ev(host: str, kind: EventKind, at: float = T0) -> WatchEvent:
    return WatchEvent(host, kind, at, f"{kind.value} detail")


def test_events_wait_for_the_window_then_go_in_order() -> None:
    cfg = PolicyConfig(burst_s=30, summarize_at=3)
    state, out = plan(PolicyState(), [ev("a", K.CRASHED)], T0, cfg)
    assert out == [] and state.window_opened == T0
    state, out = plan(state, [ev("b", K.STALLED, T0 + 5)], T0 + 5, cfg)
    assert out == []
    state, out = plan(state, [], T0 + 30, cfg)
    assert [n.title for n in out] == ["dflash a: crashed", "dflash b: stalled"]
    assert [n.severity for n in out] == ["failure", "failure"]
    assert state.pending == () and state.window_opened is None
    state, out = plan(state, [], T0 + 100, cfg)
    assert out == []


def test_a_burst_of_one_kind_is_one_message_others_stay_single() -> None:
    evs = [ev(f"h{i}", K.UNREACHABLE, T0 + i) for i in range(5)]
    evs.insert(2, ev("x", K.RESTARTED, T0 + 1.5))
    out = flush(evs, summarize_at=3)
    assert [n.title for n in out] == [
        "dflash: 5 hosts unreachable (h0, h1, h2, h3, h4)",
        "dflash x: restarted",
    ]
    assert len(out[0].events) == 5 and out[0].body.count("\n") == 4
    assert [n.title for n in flush(evs[:2], summarize_at=3)] == [
        "dflash h0: unreachable",
        "dflash h1: unreachable",
    ]


def test_one_hosts_repeats_in_a_window_are_one_message() -> None:
    evs = [ev("a", K.RESTARTED, T0 + i) for i in range(3)] + [ev("b", K.RESTARTED, T0 + 5)]
    out = flush(evs, summarize_at=3)
    assert [n.title for n in out] == ["dflash a: restarted 3 times", "dflash b: restarted"]
    assert out[0].body.count("\n") == 2 and len(out[0].events) == 3


def test_zero_window_sends_at_once_and_recovered_is_success() -> None:
    cfg = PolicyConfig(burst_s=0, unreachable_alert_s=60)
    state = PolicyState()
    state, _, out = plan_round(state, [HostSnapshot("a", T0, True, Condition.RUNNING)], T0, cfg)
    state, evs, out = plan_round(
        state, [HostSnapshot("a", T0 + 1, True, Condition.CRASHED, exit_status=1)], T0 + 1, cfg
    )
    assert [e.kind for e in evs] == [K.CRASHED]
    assert [n.title for n in out] == ["dflash a: crashed"] and "exit 1" in out[0].body
    state, _, out = plan_round(
        state, [HostSnapshot("a", T0 + 2, True, Condition.RUNNING)], T0 + 2, cfg
    )
    assert [(n.title, n.severity) for n in out] == [("dflash a: recovered (crashed)", "success")]


_kinds = st.sampled_from(list(EventKind))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.tuples(st.sampled_from("abcdef"), _kinds), max_size=6), st.floats(0, 60)
        ),
        max_size=20,
    ),
    st.integers(2, 5),
)
def test_every_event_is_sent_exactly_once_in_order(
    rounds: list[tuple[list[tuple[str, EventKind]], float]], summarize_at: int
) -> None:
    cfg = PolicyConfig(burst_s=30, summarize_at=summarize_at)
    state, now, sent, made = PolicyState(), T0, [], []
    for batch, dt in rounds:
        now += dt
        evs = [ev(h, k, now) for h, k in batch]
        made += evs
        state, out = plan(state, evs, now, cfg)
        check(out)
        sent += [e for n in out for e in n.events]
    state, out = plan(state, [], now + cfg.burst_s, cfg)
    check(out)
    sent += [e for n in out for e in n.events]
    assert sorted(map(id, sent)) == sorted(map(id, made))  # each once, none lost


def check(out: list[Notification]) -> None:
    firsts = [n.events[0].at for n in out]
    assert firsts == sorted(firsts)  # messages go in the order their first event happened
    for n in out:
        if len(n.events) > 1:  # a summary: one kind, one host's repeats or many hosts
            assert len({main_kind(n)} | {e.kind for e in n.events} - {K.RESTARTED}) == 1
    keys = [
        (main_kind(n), n.events[0].host if len({e.host for e in n.events}) == 1 else None)
        for n in out
    ]
    assert len(keys) == len(set(keys))  # a window never repeats a message for one kind and host


def main_kind(n: Notification) -> EventKind:
    """The message's kind: a gave-up's, when restarts were folded into it."""
    kinds = {e.kind for e in n.events}
    if K.GAVE_UP in kinds:
        assert kinds <= {K.GAVE_UP, K.RESTARTED}, kinds  # only restarts are folded into it
        return K.GAVE_UP
    return n.events[0].kind


def test_a_crash_loop_in_one_window_is_one_gave_up_message() -> None:
    """Restarts, then the gave-up, of host a in one window: one message, the restarts listed
    first; b's restart (no gave-up) stays its own message."""
    evs = [
        ev("a", K.RESTARTED, T0 + 1),
        ev("b", K.RESTARTED, T0 + 2),
        ev("a", K.RESTARTED, T0 + 3),
        ev("a", K.GAVE_UP, T0 + 4),
    ]
    out = flush(evs, summarize_at=3)
    assert [(n.title, n.severity) for n in out] == [
        ("dflash a: gave-up", "failure"),
        ("dflash b: restarted", "warning"),
    ]
    assert [e.kind for e in out[0].events] == [K.RESTARTED, K.RESTARTED, K.GAVE_UP]
    assert out[0].body.splitlines()[-1].endswith("a gave-up: gave-up detail")
    assert out[0].body.count("a restarted: restarted detail") == 2
    # the restarts of a window before the gave-up's window went on their own
    assert [n.title for n in flush(evs[3:])] == ["dflash a: gave-up"]
