"""The demo TUI in a real terminal: tmux runs `dflashctl demo`, capture-pane reads the screen.

Everything is real: LocalTransport, deploy, the trainer on CPU under tmux, the TUI. The test sees
live values change, edits the demo config, presses `r`, confirms, and sees the restarted run.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import budget
from tests.conftest import demo_processes, require_part, run_headless_demo
from tests.terminal import Terminal
from trainer.config import TrainConfig, config_hash
from trainer.events import StatusEvent, parse_line

ROOT = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\s*demo\s+(\S+)\s+\S+\s+(\d+)\s", re.M)
LIVE_EDIT_BUDGET_S = 900.0
"""The whole live-edit test's budget (tests/budget.py stretches it on a loaded machine): every
step waits on its condition until it runs out, so a machine that is slow at one step (the first
run's startup, the restart) is not failed for it; only a run stuck for this long is."""


def _row(text: str) -> tuple[str, int] | None:
    m = ROW.search(text)
    return (m.group(1), int(m.group(2))) if m else None


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(LIVE_EDIT_BUDGET_S)
def test_demo_tui_live_edit_and_one_key_restart(tmp_path: Path) -> None:
    require_part(shutil.which("tmux") is not None, "tmux is not installed")
    require_part(importlib.util.find_spec("torch") is not None, "torch (the train extra) missing")
    require_part((ROOT / "trainer" / "__main__.py").exists(), "`python -m trainer` not present")
    tag = f"{os.getpid()}"
    session = f"dflash-demo-test-{tag}"
    term = Terminal(f"dflash-tuitest-{tag}")
    demo_dir = tmp_path / "demo"
    editor = tmp_path / "editor.sh"  # a scripted "user" editing the file the app hands it
    editor.write_text("#!/bin/sh\nsed -i 's/^interval_s = 2$/interval_s = 1/' \"$1\"\n")
    editor.chmod(0o755)
    env = {"TERM": "xterm-256color", "OMP_NUM_THREADS": "1", "COLUMNS": "140", "LINES": "45"}
    env |= {"EDITOR": str(editor), "VISUAL": ""}
    wait = term.wait

    try:
        term.start(
            [sys.executable, "-m", "dflashctl.demo", "--dir", str(demo_dir), "--session", session],
            env,
        )
        first = wait(
            "a running demo row with a step", lambda t: (_row(t) or ("", 0))[0] == "running"
        )
        step0 = _row(first)[1]  # type: ignore[index]
        live = wait("the step to advance", lambda t: (_row(t) or ("", -1))[1] > step0)
        assert "Ktok/s" in live and "ETA" in live

        config = demo_dir / "demo.toml"
        assert "interval_s = 2" in config.read_text()
        term.keys("e")  # the app suspends and runs $EDITOR on the demo config
        wait("the fleet to flag the change", lambda t: "changed" in t)
        assert "interval_s = 1" in config.read_text()

        term.keys("r")
        modal = wait("the restart modal", lambda t: "Restart demo" in t and "Will" in t)
        assert "+interval_s = 1" in modal and "-interval_s = 2" in modal
        assert "resume from the latest checkpoint" in modal
        before = _row(term.screen())
        term.keys("Enter")
        wait("the restart result", lambda t: "restarted (resume)" in t)
        term.keys("Enter")
        after = wait(
            "the restarted run to report",
            lambda t: "changed" not in t and (_row(t) or ("", -1))[0] == "running",
        )
        assert before is not None and _row(after) is not None
        run_dir = demo_dir / "host" / "run"
        assert "interval_s = 1" in (run_dir / "config.toml").read_text()
        want = config_hash(TrainConfig.load(config))
        budget.until(
            lambda: json.loads((run_dir / "run-state.json").read_text()).get("config_hash") == want,
            "the restarted run to report the new config",
            every=0.5,
        )
        wait("status lines from the restarted run", lambda t: (_row(t) or ("", -1))[1] >= 0)
        term.keys("q")
        wait("the demo to stop its run and exit", lambda t: "stop:" in t)
    finally:
        term.kill()
        subprocess.run(
            ["tmux", "-L", "dflash", "kill-session", "-t", f"={session}"],
            check=False,
            capture_output=True,
        )


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_headless_demo_prints_the_last_status_line_and_stops(tmp_path: Path) -> None:
    session = f"dflash-demo-headless-{os.getpid()}"
    done = run_headless_demo(tmp_path / "demo", session, "--until-step", "1")
    assert done.returncode == 0, done.stderr
    last = parse_line(done.stdout.strip().splitlines()[-1])
    assert isinstance(last, StatusEvent) and last.step > 0 and last.ktok_s
    alive = subprocess.run(
        ["tmux", "-L", "dflash", "has-session", "-t", f"={session}"],
        capture_output=True,
        check=False,
    )
    assert alive.returncode != 0, "the demo run was left running"


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(LIVE_EDIT_BUDGET_S)
def test_sigterm_to_the_demo_tui_stops_its_run_as_q_does(tmp_path: Path) -> None:
    """The fault: SIGTERM (what `timeout` sends) ended `dflashctl demo` at once and left its
    trainer training in the tmux session. Now the TUI closes and the run is stopped, as `q` does,
    and the demo exits 143."""
    require_part(shutil.which("tmux") is not None, "tmux is not installed")
    require_part(importlib.util.find_spec("torch") is not None, "torch (the train extra) missing")
    tag = f"{os.getpid()}"
    session, term = f"dflash-demo-term-{tag}", Terminal(f"dflash-tuiterm-{tag}")
    demo_dir, sock = tmp_path / "demo", tmp_path / "tmux"
    sock.mkdir()  # the demo's tmux server (-L dflash) is this test's alone
    env = {"TERM": "xterm-256color", "OMP_NUM_THREADS": "1", "COLUMNS": "140", "LINES": "45"}
    env |= {"TMUX_TMPDIR": str(sock)}
    wait = term.wait

    def demo_session() -> bool:
        argv = ["tmux", "-L", "dflash", "has-session", "-t", f"={session}"]
        return subprocess.run(argv, env={**os.environ, **env}, check=False).returncode == 0

    try:
        argv = [sys.executable, "-m", "dflashctl", "demo", "--dir", str(demo_dir)]
        term.start([*argv, "--session", session], env)
        wait("a running demo row", lambda t: (_row(t) or ("", 0))[0] == "running")
        shell = int(term.tmux("display-message", "-p", "-t", "=tui:", "#{pane_pid}"))
        demo = [
            int(pid)
            for pid in subprocess.run(
                ["pgrep", "-P", str(shell)], capture_output=True, text=True, check=False
            ).stdout.split()
        ]
        assert len(demo) == 1, demo  # `env ... python -m dflashctl demo`, exec'd by env
        os.kill(demo[0], signal.SIGTERM)
        screen = wait("the demo to exit", lambda t: "exit=" in t)
        assert "exit=143" in screen and "SIGTERM: stopping the demo run gracefully" in screen
        assert "stop: stopped (" in screen, screen
        budget.until(
            lambda: not demo_session() and not demo_processes(demo_dir),
            "the demo's session and processes to end",
            detail=lambda: str(demo_processes(demo_dir)),
        )
    finally:
        term.kill()
        subprocess.run(["tmux", "-L", "dflash", "kill-server"], env={**os.environ, **env})
        for left in demo_processes(demo_dir):
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(left.split()[0]), signal.SIGKILL)
