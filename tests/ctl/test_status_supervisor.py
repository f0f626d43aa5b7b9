"""status reads RUN/supervisor.json in its one round trip: restarts, supervisor, new states;
and a running `dflashctl measure` (its id, since when, its last progress line).

The parser is pure; the real-parts tests (test_supervised_run.py) run the same path through
sshd, pct, LXC and tmux with the real supervisor and trainer.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflashctl.alerts.events import Condition, snapshot_from_status
from dflashctl.cli.status_text import format_run_status, low_disk_lines, supervisor_lines
from dflashctl.remote.commands import supervised
from dflashctl.remote.run import MARK, STATUS_SCRIPT
from dflashctl.runs.snapshot import parse_status, split_sections
from tests import budget
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


def test_low_disk_is_one_status_line_per_filesystem_in_the_supervisors_words() -> None:
    now = 1_000_000.0
    since = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now - 185))
    # the supervisor's entries (trainer.supervision.filesystems.Space.as_json + since)
    ckpts = {
        "free_mib": 2.5,
        "needed_mib": 3.0,
        "checkpoint_mib": 1.0,
        "checkpoints": 4,
        "path": "/w/run/checkpoints",
        "holds": ["checkpoints"],
        "text": "2.5 MiB free on /w/run/checkpoints, checkpoints need 3.0 MiB: the newest "
        "checkpoint (1.0 MiB) x 4 checkpoints on disk at the peak of a write",
        "consequence": "a later checkpoint will fail",
        "since": since,
    }
    logs = {
        "free_mib": 1.0,
        "needed_mib": 16.0,
        "path": "/w/run/tb",
        "holds": ["tracker"],
        "text": "1.0 MiB free on /w/run/tb, logs keep 16 MiB",
        "consequence": "logs and tracker files will stop being written",
    }
    sup_json = {"low_disk": ckpts, "low_disks": [ckpts, logs]}
    assert low_disk_lines(sup_json, now) == [
        "disk: LOW: 2.5 MiB free on /w/run/checkpoints, checkpoints need 3.0 MiB: the newest "
        "checkpoint (1.0 MiB) x 4 checkpoints on disk at the peak of a write for 3m05s: a later "
        "checkpoint will fail unless space is freed",
        "disk: LOW: 1.0 MiB free on /w/run/tb, logs keep 16 MiB: logs and tracker files will "
        "stop being written unless space is freed",
    ]
    # an older supervisor: figures only, said plainly (no unexplained multiplier)
    full = {"free_mib": 0.5, "needed_mib": 1.0, "checkpoint_mib": 1.0, "checkpoints": 1}
    assert low_disk_lines({"low_disk": full}, now) == [
        "disk: LOW: 0.5 MiB free on the run directory, checkpoints need 1 MiB: "
        "the next checkpoint will fail unless space is freed"
    ]
    assert low_disk_lines({"low_disk": None}, now) == [] and low_disk_lines(None, now) == []
    st = status(out("0|||40", sup(40, "running", low_disk=ckpts, low_disks=[ckpts, logs])))
    lines = format_run_status(st).splitlines()
    assert lines[1].startswith("  supervisor: running, attempt 1;")
    assert lines[2].startswith("  disk: LOW: 2.5 MiB free on /w/run/checkpoints, ")
    assert lines[3].startswith("  disk: LOW: 1.0 MiB free on /w/run/tb, ") and len(lines) == 4


# Writes RUN/checkpoints/step-00000001.pt of 1 MiB (a stand-in for the trainer's checkpoint),
# then runs until RUN/done exists and exits 0.
CHILD = (
    "import os, sys, time\n"
    "run = sys.argv[1]\n"
    "os.makedirs(run + '/checkpoints', exist_ok=True)\n"
    "open(run + '/checkpoints/step-00000001.pt', 'wb').write(b'\\0' * 1048576)\n"
    "open(run + '/checkpoints/.written', 'w').close()\n"
    "while not os.path.exists(run + '/done'): time.sleep(0.05)\n"
)


def _until(cond: Callable[[], bool], what: str) -> None:
    budget.until(cond, what)


def _file(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):  # not written yet
        return {}
    return data if isinstance(data, dict) else {}


@pytest.mark.timeout(90)
def test_low_disk_as_the_real_supervisor_writes_it_reaches_status_text_and_json(
    small_fs: Path, tmp_path: Path
) -> None:
    """The real `python -m trainer.supervise` on a 4 MiB disk: its child wrote a 1 MiB
    checkpoint, a filler leaves 0.5 MiB; the supervisor.json it then writes is what status
    reads, and the line goes when the space comes back."""
    run = small_fs / "run"
    argv = [sys.executable, "-m", "trainer.supervise", "--run-dir", str(run)]
    argv += ["--disk-check-s", "0.1", "--", sys.executable, "-c", CHILD, str(run)]
    root = Path(__file__).resolve().parents[2]
    with open(tmp_path / "out", "w") as log:
        proc = subprocess.Popen(
            argv, cwd=root, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        sup_json = run / "supervisor.json"
        _until(lambda: (run / "checkpoints" / ".written").exists(), "the child's checkpoint")
        _until(lambda: _file(sup_json).get("state") == "running", "the supervisor to run")
        st = os.statvfs(small_fs)
        filler = small_fs / "filler"
        filler.write_bytes(b"\0" * (st.f_bavail * st.f_frsize - 512 * 1024))
        _until(lambda: bool(_file(sup_json).get("low_disk")), "supervisor.json's low_disk")
        text = sup_json.read_text()
        written = json.loads(text)
        assert written["pid"] == proc.pid
        got = status(out(f"0|||{proc.pid}", None, supervisor=text))
        d = json.loads(json.dumps(got.to_json_dict(), default=str))
        assert d["state"] == "running" and d["supervisor"]["low_disk"] == written["low_disk"]
        line = next(ln for ln in format_run_status(got).splitlines() if "disk:" in ln)
        assert re.fullmatch(
            rf"  disk: LOW: 0\.\d MiB free on {re.escape(str(run))}, checkpoint needs 1\.0 for "
            r"\d+s: the next checkpoint will fail unless space is freed",
            line,
        ), line
        filler.unlink()
        _until(lambda: _file(sup_json).get("low_disk", 0) is None, "low_disk to clear")
        got = status(out(f"0|||{proc.pid}", None, supervisor=sup_json.read_text()))
        assert got.to_json_dict()["supervisor"]["low_disk"] is None
        assert "disk:" not in format_run_status(got)
        (run / "done").touch()
        assert budget.wait(proc, "the supervisor to exit") == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


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


# --- a running `dflashctl measure`, read in the same round trip -------------------------------

MEASURE_ID = "20261201T170211Z"
STARTED = 1796144531  # MEASURE_ID as epoch seconds


def measuring(pane: str, progress: str = "", measure: str = MEASURE_ID) -> str:
    return out(
        "",
        None,
        session="no",
        measure=measure,
        measure_pane=pane,
        measure_progress=progress,
        now=str(STARTED + 190),
    )


def test_a_running_measure_is_status_text_and_json() -> None:
    progress = "round 1/2 sorted: 1,000 tok/s (run 1 of 4)\nround 1/2 packed: 9\x1b[31m tok/s\n\n"
    st = status(measuring("0|||77", progress))
    assert st.state == "stopped" and st.measure is not None
    assert st.measure.id == MEASURE_ID and st.measure.session == "dflash-measure"
    assert st.measure.since == "2026-12-01 17:02:11 UTC" and st.measure.age_s == 190
    assert st.measure.progress == "round 1/2 packed: 9 tok/s"  # the last line, made safe
    d = json.loads(json.dumps(st.to_json_dict(), default=str))
    assert d["measure"] == {
        "id": MEASURE_ID,
        "session": "dflash-measure",
        "since": "2026-12-01 17:02:11 UTC",
        "age_s": 190,
        "progress": "round 1/2 packed: 9 tok/s",
    }
    lines = format_run_status(st).splitlines()
    assert lines[1] == (
        f"  measure: {MEASURE_ID} running since 2026-12-01 17:02:11 UTC (3m10s ago) in tmux "
        "session 'dflash-measure': round 1/2 packed: 9 tok/s (`dflashctl measure h --result`)"
    )
    named = parse_status("h", measuring("0|||77"), lambda _t: None, session="gpu")
    assert named.measure is not None and named.measure.session == "gpu-measure"
    assert (
        format_run_status(named)
        .splitlines()[1]
        .endswith("'gpu-measure': no timing run has finished yet (`dflashctl measure h --result`)")
    )


def test_a_measure_that_is_not_running_is_not_shown() -> None:
    for text in (
        measuring("1|0||77"),  # its pane died (remain-on-exit)
        measuring(""),  # no session: lost (a container restart) or stopped
        measuring("0|||77", measure="../../etc"),  # not a measure id
        out("0|||40", None),  # no measure at all
        out("0|||40", None, measure=""),  # the newest has its exit status: --result's
    ):
        st = status(text)
        assert st.measure is None and st.to_json_dict()["measure"] is None
        assert "measure" not in format_run_status(st)


def test_the_status_script_reads_the_newest_measure_without_an_exit_status(
    tmp_path: Path,
) -> None:
    """The script for real (sh), a stand-in `tmux` on PATH whose only live pane is the measure
    session's: the newest measure's id, pane and last progress lines; nothing once it exited."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tmux = bin_dir / "tmux"
    tmux.write_text('#!/bin/sh\ncase "$*" in *"=s-measure:"*) echo "0|||77";; *) exit 1;; esac\n')
    tmux.chmod(0o755)
    wd = tmp_path / "wd"
    for mid in ("20261130T090000Z", MEASURE_ID, "notes"):
        (wd / "measure" / mid).mkdir(parents=True)
    (wd / "measure" / "20261130T090000Z" / "progress.log").write_text("old\n")
    (wd / "measure" / MEASURE_ID / "progress.log").write_text("".join(f"l{i}\n" for i in range(9)))

    def run() -> dict[str, str]:
        got = subprocess.run(
            ["sh", "-c", STATUS_SCRIPT, "dflash-status", str(wd), "s"],
            capture_output=True,
            text=True,
            env={"PATH": f"{bin_dir}:/usr/bin:/bin"},
            timeout=budget.left(),
            check=True,
        )
        return split_sections(got.stdout)

    got = run()
    assert got["measure"] == MEASURE_ID and got["measure_pane"] == "0|||77"
    assert got["measure_progress"] == "l4\nl5\nl6\nl7\nl8" and got["now"].isdigit()
    assert got["session"] == "no"  # the run's own session is not the measure's
    (wd / "measure" / MEASURE_ID / "exit-status").write_text("0\n")
    got = run()
    assert got["measure"] == "" and "measure_pane" not in got and "now" not in got
