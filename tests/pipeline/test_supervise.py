"""The supervisor (`python -m trainer.supervise`) with real processes: the tiny CPU trainer where
the trainer matters (kill -9, SIGSTOP, divergence, a graceful stop), small scripted children
where it does not (a crash loop, a hang, exit 2, counting the SIGINTs that reach the child)."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests import budget
from tests.conftest import require_part
from trainer.config.policy import Ending, Policy, decide, reason, restart_argv
from trainer.events import (
    CheckpointEvent,
    PhaseEvent,
    StatusEvent,
    format_phase_line,
    parse_line,
)
from trainer.supervision.progress import Progress

from .conftest import REPO, cli_env, trainer_argv, write_config


def _until(cond: Callable[[], bool], what: str) -> None:
    budget.until(cond, what)


def _sup_argv(run_dir: Path, *opts: str, child: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer.supervise",
        "--run-dir",
        str(run_dir),
        *opts,
        "--",
        *child,
    ]


def _script(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _events(run_dir: Path) -> list[Any]:
    log = run_dir / "status.log"
    return [parse_line(x) for x in log.read_text().splitlines()] if log.exists() else []


def _phases(run_dir: Path, phase: str) -> list[PhaseEvent]:
    return [e for e in _events(run_dir) if isinstance(e, PhaseEvent) and e.phase == phase]


def _json_object(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _sup_state(run_dir: Path) -> dict[str, Any]:
    return _json_object(run_dir / "supervisor.json")


def _run_state(run_dir: Path) -> dict[str, Any]:
    return _json_object(run_dir / "run-state.json")


def _metric_rows(run_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        with contextlib.suppress(ValueError):  # a line cut by kill -9
            rows.append(json.loads(line))
    return rows


class Sup:
    """A supervisor process in its own session (like the tmux pane's foreground group)."""

    def __init__(self, argv: list[str], out: Path, env: dict[str, str] | None = None) -> None:
        self.out = out
        self.fh = open(out, "w")  # noqa: SIM115
        self.proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env or cli_env(),
            stdout=self.fh,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def ctrl_c(self) -> None:
        """What tmux does for C-c: SIGINT to the whole foreground process group."""
        os.killpg(self.proc.pid, signal.SIGINT)

    def wait(self) -> int:
        """Its exit status, waited for within the test's one budget."""
        rc = budget.wait(self.proc, "the supervisor to exit")
        self.fh.close()
        return rc

    def text(self) -> str:
        return self.out.read_text()

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.fh.close()


@pytest.fixture
def sups() -> Iterator[list[Sup]]:
    started: list[Sup] = []
    yield started
    for s in started:
        s.cleanup()


# Appends a line per start to STARTS, then exits with CODE.
EXITS = "import sys; open(sys.argv[1], 'a').write('start\\n'); sys.exit(int(sys.argv[2]))"


@dataclass(frozen=True)
class Exiting:
    """A supervisor over the EXITS child: `starts` gets a line per start of the child."""

    run: Path
    starts: Path
    sup: Sup


StartExiting = Callable[..., Exiting]


@pytest.fixture
def exiting(tmp_path: Path, sups: list[Sup]) -> StartExiting:
    """`exiting(code, *supervisor options)`: start a supervisor whose child exits with code."""

    def start(code: int, *opts: str) -> Exiting:
        run, starts = tmp_path / "run", tmp_path / "starts"
        argv = _sup_argv(run, *opts, child=[*_script(EXITS), str(starts), str(code)])
        s = Sup(argv, tmp_path / "out")
        sups.append(s)
        return Exiting(run, starts, s)

    return start


# ---------------------------------------------------------------------------- pure policy


def test_restart_argv_drops_fresh_and_resumes_auto() -> None:
    base = ["python", "-m", "trainer", "--config", "c.toml", "--run-dir", "run"]
    assert restart_argv([*base, "--fresh"], wrote_checkpoint=False) == base
    assert restart_argv([*base, "--resume", "never"], wrote_checkpoint=False) == [
        *base,
        "--resume",
        "auto",
    ]
    # An explicit checkpoint is kept until this run has written one of its own.
    assert restart_argv([*base, "--resume=/x/step-5.pt"], wrote_checkpoint=False)[-1] == (
        "/x/step-5.pt"
    )
    assert restart_argv([*base, "--resume", "/x/step-5.pt"], wrote_checkpoint=True)[-1] == "auto"


def test_decide_and_reasons() -> None:
    p = Policy()
    assert decide(Ending(returncode=-9), p) == ("failure", "signal 9")
    assert decide(Ending(returncode=1, stalled_s=900.0), p) == ("failure", "stalled 900 s")
    # our own SIGINT made the stalled trainer exit 0 "stopped": still a failure
    assert decide(Ending(returncode=0, stalled_s=5.0, trainer_state="stopped"), p)[0] == "failure"
    assert decide(Ending(returncode=0, trainer_state="finished"), p)[0] == "finished"
    assert decide(Ending(returncode=1, trainer_state="stopped"), p)[0] == "stopped"
    assert decide(Ending(returncode=-9, operator_stop=True), p)[0] == "stopped"
    assert decide(Ending(returncode=2), p)[0] == "not-restarted"
    # under torchrun the child's exit is 1 whatever the rank's: the rank's recorded code counts
    assert decide(Ending(returncode=1, trainer_exit=2), p) == (
        "not-restarted",
        "the trainer's exit 2 (launcher exit 1) is in no_restart_exit_codes",
    )
    assert decide(Ending(returncode=1, trainer_exit=4), p)[0] == "failure"
    # the trainer's stop for checkpoints that keep failing (exit 3): never restarted, whatever
    # no_restart_exit_codes says (dflashctl passes its own list)
    unsaved = decide(Ending(returncode=3), Policy(no_restart_exit_codes=frozenset()))
    assert unsaved[0] == "not-restarted" and unsaved[1].startswith("checkpoints kept failing")
    assert decide(Ending(returncode=1, trainer_exit=3), p)[0] == "not-restarted"
    assert decide(Ending(returncode=3, operator_stop=True), p)[0] == "stopped"
    assert decide(Ending(returncode=1), Policy(restart="never"))[0] == "not-restarted"
    err = "stage drafter failed: NonFiniteLoss: 3 non-finite losses in a row (step 12)"
    assert decide(Ending(returncode=1, errors=(err,)), p)[0] == "not-restarted"
    assert reason(Ending(returncode=-9, oom_killed=True)) == "oom"
    oom = "stage target failed: OutOfMemoryError: CUDA out of memory"
    assert reason(Ending(returncode=1, errors=(oom,))) == "oom"
    assert [Policy(backoff_s=2, backoff_max_s=10).backoff(n) for n in (1, 2, 3, 4)] == [2, 4, 8, 10]


def test_policy_cli_args_round_trip_through_the_parser() -> None:
    """What dflashctl will put before `--` gives back exactly the policy it came from."""
    from trainer.supervise import _parser, parse_policy

    for policy in (
        Policy(),
        Policy(
            restart="never", max_restarts=0, restart_window_s=1234567.891, stall_timeout_s=3,
            startup_timeout_s=7, no_restart_exit_codes=frozenset({2, 3, 77}), backoff_s=0.25,
            backoff_max_s=4, kill_grace_s=1.5,
        ),
    ):  # fmt: skip
        parser = _parser()
        assert parse_policy(parser, parser.parse_args(policy.cli_args())) == policy


def test_supervisor_is_torch_free() -> None:
    code = "import sys, trainer.supervise; assert 'torch' not in sys.modules, 'torch imported'"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_a_checkpoint_past_the_start_ends_the_startup_timeout() -> None:
    """Ten fast steps and a checkpoint before the first status interval: training, so the stall
    timeout applies from then on (a stop right after it is a stall, not a slow startup)."""
    p = Progress(0.0)
    p.feed_lines([format_phase_line("resuming", "step=20 path=run/checkpoints/x.pt")], 1.0)
    assert (p.resumed_step, p.trained, p.idle_limit(10, 600)) == (20, False, 600)
    p.feed_lines(["Checkpoint saved: step=20 path=run/checkpoints/step-00000020.pt"], 2.0)
    assert not p.trained and p.last_progress == 2.0  # the step it resumed from: no training
    p.feed_lines(["Checkpoint saved: step=30 path=run/checkpoints/step-00000030.pt"], 3.0)
    assert p.trained and p.idle_limit(10, 600) == 10 and p.checkpoint_step == 30


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ([], "no trainer argv"),
        (["--max-restarts", "x", "--", "true"], "--max-restarts: 'x' is not a whole number"),
        (["--no-restart-exit-codes", "2,300", "--", "true"], "'300' is not an exit status"),
        (["--", "true"], "has no --run-dir"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(args: list[str], message: str) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "trainer.supervise", *args], cwd=REPO, capture_output=True, text=True
    )
    assert out.returncode == 2 and message in out.stderr.splitlines()[-1], out.stderr


def test_a_trainer_that_cannot_start_is_one_line_and_exit_2(tmp_path: Path) -> None:
    argv = _sup_argv(tmp_path / "run", child=[str(tmp_path / "no-such-python"), "-m", "trainer"])
    out = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=budget.left())
    assert out.returncode == 2
    assert out.stdout.splitlines() == [
        f"ERROR: cannot start the trainer {str(tmp_path / 'no-such-python')!r}: "
        "No such file or directory"
    ]
    assert _sup_state(tmp_path / "run")["state"] == "failed"


# ---------------------------------------------------------------------------- scripted children


@pytest.mark.timeout(60)
def test_a_crash_loop_is_restarted_max_restarts_times_then_gives_up_once(
    exiting: StartExiting,
) -> None:
    ex = exiting(1, "--max-restarts", "2", "--backoff-s", "0.05")
    run, starts, s = ex.run, ex.starts, ex.sup
    assert s.wait() == 1
    assert starts.read_text().count("start") == 3  # the first attempt + 2 restarts
    state = _sup_state(run)
    assert state["state"] == "gave-up" and state["gave_up"] is True
    assert [r["reason"] for r in state["restarts"]] == ["exit 1", "exit 1"]
    assert [r["exit_status"] for r in state["restarts"]] == [1, 1]
    assert [r["backoff_s"] for r in state["restarts"]] == [0.05, 0.1]  # grows per attempt
    gave_up = _phases(run, "gave_up")
    assert len(gave_up) == 1 and gave_up[0].detail.startswith("after 2 restarts in ")
    assert gave_up[0].detail.endswith(": exit 1, exit 1, exit 1")
    assert len(_phases(run, "restarting")) == 2
    assert s.text().count("Supervisor gave up") == 1


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    ("code", "opts", "why"),
    [
        (2, [], "exit 2 is in no_restart_exit_codes"),
        (7, ["--no-restart-exit-codes", "2,7"], "exit 7 is in no_restart_exit_codes"),
        (1, ["--restart", "never"], "exit 1; restart = never"),
    ],
)
def test_no_restart_exit_codes_and_restart_never_are_not_restarted(
    exiting: StartExiting, code: int, opts: list[str], why: str
) -> None:
    ex = exiting(code, *opts, "--backoff-s", "0.05")
    run, starts, s = ex.run, ex.starts, ex.sup
    assert s.wait() == code
    assert starts.read_text().count("start") == 1
    assert _sup_state(run)["state"] == "not-restarted" and _sup_state(run)["restarts"] == []
    (line,) = _phases(run, "not_restarting")
    assert line.detail == why


# A launcher (torchrun's role) whose child writes run-state.json as rank 0 would: its own pid,
# the launcher as parent, exit_status 2; the launcher exits 1, as torchrun does for any failure.
LAUNCHER = """
import json, os, subprocess, sys
run, starts = sys.argv[1], sys.argv[2]
open(starts, "a").write("start\\n")
rank = (
    "import json, os, sys; os.makedirs(sys.argv[1], exist_ok=True); "
    "open(os.path.join(sys.argv[1], 'run-state.json'), 'w').write(json.dumps("
    "{'pid': os.getpid(), 'parent_pid': os.getppid(), 'state': 'refused', 'exit_status': 2}))"
    "; sys.exit(2)"
)
code = subprocess.run([sys.executable, "-c", rank, run]).returncode
sys.exit(1 if code else 0)
"""


@pytest.mark.timeout(60)
def test_a_rank_s_no_restart_code_counts_through_a_launcher(
    tmp_path: Path, sups: list[Sup]
) -> None:
    """The supervisor's child is torchrun (exit 1 for any rank failure); rank 0's recorded exit 2
    (a usage error) is in no_restart_exit_codes, so it is not restarted."""
    run, starts = tmp_path / "run", tmp_path / "starts"
    argv = _sup_argv(run, "--backoff-s", "0.05", child=[*_script(LAUNCHER), str(run), str(starts)])
    s = Sup(argv, tmp_path / "out")
    sups.append(s)
    assert s.wait() == 1
    assert starts.read_text().count("start") == 1
    assert _sup_state(run)["state"] == "not-restarted"
    (line,) = _phases(run, "not_restarting")
    assert line.detail == "the trainer's exit 2 (launcher exit 1) is in no_restart_exit_codes"


@pytest.mark.timeout(60)
def test_restarts_older_than_the_window_do_not_count(tmp_path: Path, sups: list[Sup]) -> None:
    """max_restarts 1 within 0.5 s: failures 0.8 s apart are restarted every time."""
    run, starts = tmp_path / "run", tmp_path / "starts"
    child = _script(
        "import sys, time\n"
        "f = open(sys.argv[1], 'a'); f.write('start\\n'); f.close()\n"
        "n = open(sys.argv[1]).read().count('start')\n"
        "time.sleep(0.8)\n"
        "sys.exit(1 if n <= 3 else 0)\n"
    )
    argv = _sup_argv(
        run, "--max-restarts", "1", "--restart-window-s", "0.5", "--backoff-s", "0.05",
        child=[*child, str(starts)],
    )  # fmt: skip
    s = Sup(argv, tmp_path / "out")
    sups.append(s)
    assert s.wait() == 0
    state = _sup_state(run)
    assert state["state"] == "finished" and not state["gave_up"]
    assert [r["reason"] for r in state["restarts"]] == ["exit 1"] * 3
    assert [r["backoff_s"] for r in state["restarts"]] == [0.05] * 3  # each is restart 1 of 1


@pytest.mark.timeout(60)
def test_an_oom_error_line_is_reason_oom(tmp_path: Path, sups: list[Sup]) -> None:
    run = tmp_path / "run"
    child = _script(
        "import sys\n"
        "open(sys.argv[1] + '/status.log', 'a').write("
        "'ERROR: stage target failed: OutOfMemoryError: CUDA out of memory. Tried to allocate "
        "2.00 GiB\\n')\n"
        "sys.exit(1)\n"
    )
    argv = _sup_argv(run, "--max-restarts", "1", "--backoff-s", "0.05", child=[*child, str(run)])
    s = Sup(argv, tmp_path / "out")
    sups.append(s)
    assert s.wait() == 1
    state = _sup_state(run)
    assert [r["reason"] for r in state["restarts"]] == ["oom"]
    assert _phases(run, "gave_up")[0].detail.endswith(": oom, oom")


def _limited_memory_cgroup(root: Path, name: str, limit: int) -> Path | None:
    """A new memory cgroup under this process's own with `limit` bytes; None when not allowed."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "memory" in controllers.split(","):  # v1
            base, limit_file = root / "memory" / path.lstrip("/"), "memory.limit_in_bytes"
        elif controllers == "":  # v2
            base, limit_file = root / path.lstrip("/"), "memory.max"
        else:
            continue
        cg = base / name
        try:
            cg.mkdir()
            (cg / limit_file).write_text(str(limit))
            return cg
        except OSError:
            with contextlib.suppress(OSError):
                cg.rmdir()
    return None


@pytest.mark.timeout(60)
def test_a_kernel_oom_kill_is_reason_oom(tmp_path: Path, sups: list[Sup]) -> None:
    """A real OOM kill in a 200 MiB memory cgroup: signal 9, told apart by the cgroup's count."""
    cg = _limited_memory_cgroup(Path("/sys/fs/cgroup"), f"dflash-oom-{os.getpid()}", 200 << 20)
    require_part(cg is not None, "no writable memory cgroup to hold an OOM kill (needs root)")
    assert cg is not None
    run = tmp_path / "run"
    hog = _script("import time; x = bytearray(600 << 20); time.sleep(30)")
    argv = _sup_argv(run, "--max-restarts", "1", "--backoff-s", "0.05", child=hog)
    # The supervisor enters the cgroup before exec, so it and its children count there.
    wrapped = ["sh", "-c", f'echo $$ > {cg / "cgroup.procs"} && exec "$@"', "sh", *argv]
    try:
        s = Sup(wrapped, tmp_path / "out")
        sups.append(s)
        assert s.wait() == 128 + signal.SIGKILL, s.text()
        state = _sup_state(run)
        assert [(r["reason"], r["exit_status"]) for r in state["restarts"]] == [("oom", -9)]
        assert _phases(run, "gave_up")[0].detail.endswith(": oom, oom")
    finally:
        with contextlib.suppress(OSError):
            cg.rmdir()


@pytest.mark.timeout(60)
def test_a_killed_supervisor_leaves_no_orphan_trainer(tmp_path: Path, sups: list[Sup]) -> None:
    """SIGKILL to the supervisor: the child gets SIGTERM (its graceful stop), not nothing."""
    run, seen = tmp_path / "run", tmp_path / "seen"
    child = _script(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *a: (open(sys.argv[1], 'w').write('TERM'), "
        "sys.exit(0)))\n"
        "open(sys.argv[1] + '.ready', 'w').close()\n"
        "time.sleep(60)\n"
    )
    s = Sup(_sup_argv(run, child=[*child, str(seen)]), tmp_path / "out")
    sups.append(s)
    _until(lambda: Path(f"{seen}.ready").exists(), "the child to start")
    s.proc.kill()
    s.wait()
    _until(seen.exists, "the child's SIGTERM")
    assert seen.read_text() == "TERM"


@pytest.mark.timeout(60)
def test_exit_0_is_never_restarted(exiting: StartExiting) -> None:
    ex = exiting(0)
    run, starts, s = ex.run, ex.starts, ex.sup
    assert s.wait() == 0
    assert starts.read_text().count("start") == 1 and _sup_state(run)["state"] == "finished"


@pytest.mark.timeout(60)
def test_ctrl_c_to_the_pane_reaches_the_child_exactly_once_and_is_not_restarted(
    tmp_path: Path, sups: list[Sup]
) -> None:
    """tmux's C-c signals the whole foreground group; the child must see one SIGINT, not two."""
    run, seen = tmp_path / "run", tmp_path / "seen"
    child = _script(
        "import signal, sys, time\n"
        "n = []\n"
        "signal.signal(signal.SIGINT, lambda *a: n.append(1))\n"
        "open(sys.argv[1] + '.ready', 'w').close()\n"
        "while not n: time.sleep(0.02)\n"
        "time.sleep(1.0)\n"  # time for a second SIGINT to arrive, if one is coming
        "open(sys.argv[1], 'w').write(str(len(n)))\n"
        "sys.exit(0)\n"
    )
    s = Sup(_sup_argv(run, "--backoff-s", "0.05", child=[*child, str(seen)]), tmp_path / "out")
    sups.append(s)
    _until(lambda: Path(f"{seen}.ready").exists(), "the child to start")
    s.ctrl_c()
    assert s.wait() == 0
    assert seen.read_text() == "1"
    state = _sup_state(run)
    assert state["state"] == "stopped" and state["restarts"] == [] and state["attempt"] == 1


@pytest.mark.timeout(60)
def test_a_stop_during_the_backoff_stops_for_good(exiting: StartExiting) -> None:
    ex = exiting(1, "--backoff-s", "7200")  # longer than any test budget: only a stop ends it
    run, starts, s = ex.run, ex.starts, ex.sup
    _until(lambda: _sup_state(run).get("state") == "restarting", "the restart backoff")
    s.ctrl_c()
    assert s.wait() == 1  # well before the backoff ends
    assert starts.read_text().count("start") == 1
    state = _sup_state(run)
    assert state["state"] == "stopped" and "during the restart backoff" in state["detail"]


@pytest.mark.timeout(60)
def test_a_silent_hang_is_stalled_killed_after_the_grace_and_restarted(
    tmp_path: Path, sups: list[Sup]
) -> None:
    """No output at all: the startup timeout fires; SIGINT is ignored, so SIGKILL follows."""
    run, starts = tmp_path / "run", tmp_path / "starts"
    child = _script(
        "import signal, sys, time\n"
        "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
        "open(sys.argv[1], 'a').write('start\\n')\n"
        "time.sleep(600)\n"
    )
    argv = _sup_argv(
        run, "--stall-timeout-s", "2", "--startup-timeout-s", "3", "--kill-grace-s", "0.5",
        "--max-restarts", "1", "--backoff-s", "0.05", child=[*child, str(starts)],
    )  # fmt: skip
    s = Sup(argv, tmp_path / "out")
    sups.append(s)
    assert s.wait() == 128 + signal.SIGKILL
    assert starts.read_text().count("start") == 2
    state = _sup_state(run)
    assert state["state"] == "gave-up"
    assert [(r["reason"], r["signal"]) for r in state["restarts"]] == [("stalled 3 s", "SIGKILL")]
    console = (run / "console.log").read_text()
    assert "no stack dump" in console and "still alive 0.5 s after SIGINT: SIGKILL" in console
    assert "State S (sleeping)" in console  # the /proc snapshot of the hung child


# ---------------------------------------------------------------------------- the real trainer


def _checkpoints(run: Path) -> list[int]:
    return [e.step for e in _events(run) if isinstance(e, CheckpointEvent)]


def _trained_to(run: Path, step: int) -> bool:
    return any(isinstance(e, StatusEvent) and e.step >= step for e in _events(run))


@pytest.mark.timeout(300)
def test_kill_9_after_the_first_checkpoint_restarts_and_resumes_like_an_uninterrupted_run(
    tmp_path: Path, tiny_assets: dict[str, Any], sups: list[Sup]
) -> None:
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": 30},
        checkpoint={"every_steps": 10},
    )
    ref = subprocess.run(
        trainer_argv(cfg, tmp_path / "ref"), cwd=REPO, env=cli_env(), capture_output=True,
        text=True, timeout=budget.left(),
    )  # fmt: skip
    assert ref.returncode == 0, ref.stderr[-3000:]
    ref_loss = {r["step"]: r["loss"] for r in _metric_rows(tmp_path / "ref")}

    run = tmp_path / "run"
    s = Sup(_sup_argv(run, "--backoff-s", "0.1", child=trainer_argv(cfg, run)), tmp_path / "out")
    sups.append(s)
    _until(lambda: bool(_checkpoints(run)), "the first checkpoint")
    pid = _sup_state(run)["trainer_pid"]
    assert _run_state(run)["pid"] == pid  # the supervisor's child is the trainer itself
    os.kill(pid, signal.SIGKILL)
    _until(lambda: _sup_state(run).get("attempt") == 2, "the restart")
    ckpt = max(_checkpoints(run))  # the newest checkpoint the killed trainer completed
    assert s.wait() == 0, s.text()[-3000:]

    state = _sup_state(run)
    assert state["state"] == "finished" and state["attempt"] == 2
    (rec,) = state["restarts"]
    assert (rec["reason"], rec["exit_status"], rec["signal"]) == ("signal 9", -9, "SIGKILL")
    assert rec["checkpoint_step"] == ckpt and rec["resumed_step"] == ckpt
    (line,) = _phases(run, "restarting")
    assert line.detail.startswith("signal 9 (exit status -9); restart 1 of 3")
    assert f"(step {ckpt})" in line.detail
    resumed = _phases(run, "resuming")
    assert resumed and resumed[-1].detail.startswith(f"step={ckpt} ")
    # Steps ckpt+1.. of the second attempt equal the uninterrupted run's, bit for bit.
    rows = _metric_rows(run)
    # (the killed attempt may have logged steps past its checkpoint: the restart repeats them)
    cut = max(i for i, r in enumerate(rows) if r["step"] == ckpt + 1)
    after = rows[cut:]
    before = [r["step"] for r in rows[:cut]]
    assert before == list(range(1, len(before) + 1)) and len(before) >= ckpt
    assert [r["step"] for r in after] == list(range(ckpt + 1, 31))
    assert [r["loss"] for r in after] == [ref_loss[r["step"]] for r in after]
    assert _run_state(run)["state"] == "finished"  # and a finished run is not restarted


@pytest.mark.timeout(300)
def test_sigstop_is_a_stall_with_stacks_in_the_log_then_a_restart(
    tmp_path: Path, tiny_assets: dict[str, Any], sups: list[Sup]
) -> None:
    cfg = write_config(
        tmp_path / "run.toml", tiny_assets, schedule={"max_steps": 100000},
        checkpoint={"every_steps": 5},
    )  # fmt: skip
    run = tmp_path / "run"
    argv = _sup_argv(
        run, "--stall-timeout-s", "5", "--startup-timeout-s", "120", "--kill-grace-s", "60",
        "--backoff-s", "0.1", child=trainer_argv(cfg, run),
    )  # fmt: skip
    s = Sup(argv, tmp_path / "out")
    sups.append(s)
    _until(lambda: _trained_to(run, 2), "a few steps")
    pid = _sup_state(run)["trainer_pid"]
    assert _sup_state(run)["restarts"] == []
    os.kill(pid, signal.SIGSTOP)
    _until(lambda: _sup_state(run).get("attempt") == 2, "the stall restart")
    _until(lambda: _sup_state(run)["restarts"][0]["resumed_step"] is not None, "the resume")
    rec = _sup_state(run)["restarts"][0]
    assert rec["reason"] == "stalled 5 s" and rec["resumed_step"] > 0
    console = (run / "console.log").read_text()
    assert f"trainer pid {pid} made no progress in status.log" in console
    assert "State T (stopped)" in console  # recorded before SIGCONT: a stopped process can't dump
    assert f"pid {pid} is stopped (SIGSTOP): sending SIGCONT" in console
    # faulthandler's dump: every thread of the trainer (prefetch, target, drafter, main)
    assert console.count("(most recent call first):") >= 4, console[-5000:]
    assert "File " in console.split(f"thread stacks of pid {pid}", 1)[1]
    # The operator's stop of the restarted run is graceful: one signal, never restarted.
    new_pid = _sup_state(run)["trainer_pid"]
    _until(lambda: _run_state(run).get("pid") == new_pid and _trained_to(run, 1), "training")
    s.ctrl_c()
    assert s.wait() == 0, s.text()[-3000:]
    trainer = _run_state(run)
    assert trainer["pid"] == new_pid and trainer["state"] == "stopped" and trainer["signals"] == 1
    state = _sup_state(run)
    assert state["state"] == "stopped" and len(state["restarts"]) == 1


@pytest.mark.timeout(200)
def test_non_finite_divergence_is_not_restarted(
    tmp_path: Path, tiny_assets: dict[str, Any], sups: list[Sup]
) -> None:
    cfg = write_config(tmp_path / "run.toml", tiny_assets, optimizer={"max_nonfinite": 3})
    run = tmp_path / "run"
    env = cli_env(DFLASH_NONFINITE="2:100")
    s = Sup(
        _sup_argv(run, "--backoff-s", "0.05", child=trainer_argv(cfg, run)), tmp_path / "out", env
    )
    sups.append(s)
    assert s.wait() == 1, s.text()[-3000:]
    state = _sup_state(run)
    assert state["state"] == "not-restarted" and state["restarts"] == [] and state["attempt"] == 1
    (line,) = _phases(run, "not_restarting")
    assert line.detail.startswith("non-finite divergence (exit 1)")
