"""status reads RUN/supervisor.json in its one round trip: restarts, supervisor, new states.

The parser is pure; the real-parts tests (test_supervised_run.py) run the same path through
sshd, pct, LXC and tmux with the real supervisor and trainer.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from dflashctl.cli import format_run_status, supervisor_lines
from dflashctl.control import MARK, STATUS_SCRIPT, parse_status
from dflashctl.remote.commands import supervised
from dflashctl.watch_events import Condition, snapshot_from_status
from trainer.config.policy import Policy

RESTART = {
    "at": "2026-12-01T03:00:00Z",
    "attempt": 2,
    "reason": "signal 9",
    "exit_status": -9,
    "signal": "SIGKILL",
    "checkpoint_step": 200,
    "resumed_step": 200,
    "backoff_s": 10.0,
}


def out(pane: str, sup: dict[str, Any] | None, **extra: str) -> str:
    sections = {
        "session": "yes",
        "pane": pane,
        "current": "releases/abc",
        "run_state": "",
        "log_lines": "0",
        "log": "",
        "config": "",
        "capture": "",
        "switched": "",
        "supervisor": json.dumps(sup) if sup is not None else "",
        "supervisable": "yes",
        **extra,
    }
    return "".join(f"{MARK}{k}\n{v}\n" for k, v in sections.items())


def sup(
    pid: int, state: str, restarts: list[dict[str, Any]] | None = None, **kw: Any
) -> dict[str, Any]:
    return {
        "pid": pid,
        "trainer_pid": pid + 1,
        "state": state,
        "attempt": 1 + len(restarts or []),
        "policy": Policy().as_json(),
        "restarts": restarts or [],
        "gave_up": state == "gave-up",
        "detail": None,
        **kw,
    }


def status(text: str) -> Any:
    return parse_status("h", text, lambda _t: None)


def test_the_script_reads_supervisor_json_in_the_same_round_trip() -> None:
    assert "cat run/supervisor.json" in STATUS_SCRIPT
    assert "current/trainer/supervise.py" in STATUS_SCRIPT


@pytest.mark.parametrize("state", ["restarting", "stalled"])
def test_a_live_supervisor_in_backoff_or_stall_is_that_state(state: str) -> None:
    st = status(out("0|||40", sup(40, state, [RESTART], detail="signal 9: restart 1 in 10 s")))
    assert st.state == state and st.exit_status is None
    assert st.restarts == [RESTART]
    d = st.to_json_dict()
    assert d["supervisor"]["state"] == state and d["supervisor"]["gave_up"] is False
    assert (
        d["supervisor"]["policy"]["max_restarts"] == 3 and d["restarts"][0]["reason"] == "signal 9"
    )
    assert snapshot_from_status(d, 0.0).condition == Condition(state)


def test_a_running_supervised_trainer_is_running_with_its_restarts() -> None:
    st = status(out("0|||40", sup(40, "running", [RESTART])))
    assert st.state == "running" and len(st.restarts) == 1
    text = format_run_status(st)
    assert "supervisor: running, attempt 2; restart = on-failure, at most 3 in 3600 s" in text
    assert "restart 1: signal 9, resumed from step 200 (" in text


def test_gave_up_is_its_own_state_with_the_detail() -> None:
    detail = "gave up after 2 restarts in 31 s: exit 1, exit 1, exit 1"
    st = status(out("1|1||40", sup(40, "gave-up", [RESTART, RESTART], detail=detail)))
    assert st.state == "gave-up" and st.exit_status == 1
    d = st.to_json_dict()
    assert d["supervisor"]["gave_up"] is True and len(d["restarts"]) == 2
    assert snapshot_from_status(d, 0.0).condition == Condition.GAVE_UP
    assert f"supervisor: {detail}" in format_run_status(st)


def test_low_disk_reaches_status_json_and_clears_with_the_file() -> None:
    low = {"free_mib": 0.5, "needed_mib": 1.0, "since": "2026-12-01T03:00:00Z"}
    d = status(out("0|||40", sup(40, "running", low_disk=low))).to_json_dict()
    assert d["state"] == "running" and d["supervisor"]["low_disk"] == low
    d = status(out("0|||40", sup(40, "running", low_disk=None))).to_json_dict()
    assert d["supervisor"]["low_disk"] is None


def test_an_operator_stop_in_a_backoff_is_stopped_not_crashed() -> None:
    st = status(out("1|1||40", sup(40, "stopped", [RESTART], exit_status=1)))
    assert st.state == "stopped"


def test_a_trainer_stop_recorded_by_the_supervisors_child_counts() -> None:
    run_state = json.dumps({"pid": 41, "state": "stopped", "exit_status": 0})
    # the pane (the supervisor) died by a second signal; the trainer (pid 41) had checkpointed
    st = status(out("1|||40", sup(40, "stopped"), run_state=run_state))
    assert st.state == "stopped" and st.exit_status == 0


def test_a_supervisor_file_of_another_process_is_not_this_runs() -> None:
    # left by an earlier start (pid 7): the pane's process is 40, and no restarts are claimed
    st = status(out("0|||40", sup(7, "gave-up", [RESTART])))
    assert st.state == "running" and st.supervisor is None and st.restarts == []
    st = status(out("", sup(40, "gave-up", [RESTART]), session="no"))
    assert st.state == "stopped" and st.supervisor is None  # no pane: no supervisor speaks


def test_a_corrupted_supervisor_file_is_said_not_hidden() -> None:
    st = status(out("0|||40", None, supervisor="{not json"))
    assert st.state == "running" and st.supervisor is None
    assert st.supervisor_error and st.supervisor_error.startswith(
        "run/supervisor.json is corrupted"
    )
    assert supervisor_lines(st) == [f"  {st.supervisor_error}: restarts unknown"]


def test_supervised_argv_puts_the_policy_in_front_of_the_trainer() -> None:
    argv = supervised("/py", Policy(max_restarts=1).cli_args(), ["/py", "-m", "trainer", "--x"])
    assert argv[:3] == ["/py", "-m", "trainer.supervise"] and "--max-restarts=1" in argv
    assert argv[argv.index("--") + 1 :] == ["/py", "-m", "trainer", "--x"]


def test_a_supervised_signal_death_is_named_like_a_bare_one() -> None:
    # restart = never: the trainer's SIGKILL reaches the pane as the supervisor's exit 137
    st = status(out("1|137||40", sup(40, "not-restarted", detail="signal 9; restart = never")))
    assert st.state == "crashed" and st.exit_status == 137 and st.signal == "SIGKILL"
    text = format_run_status(st)
    assert "(killed by SIGKILL)" in text and "supervisor: signal 9; restart = never" in text
