"""`dflashctl attach` in a real terminal: ssh -t -> pct shim -> lxc-attach -> tmux attach.

The argv alone (test_cli.py) cannot show that a terminal survives every hop; here a local tmux
window runs the command, the screen shows the container's session, and the tmux detach key
brings the operator back with the run still alive.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.config.inventory import HostConfig
from tests.conftest import require_part
from tests.ctl import parts as P
from tests.terminal import Terminal

pytestmark = [pytest.mark.parts, pytest.mark.timeout(120)]


def _in_container(parts: P.Parts, *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["lxc-attach", "-n", parts.container.name, "--", *argv],
        capture_output=True,
        text=True,
        check=False,
    )


def test_attach_shows_the_run_and_detaches_leaving_it_running(
    real_parts: P.Parts, ssh_host: HostConfig, clean_workdir: Path
) -> None:
    require_part(shutil.which("ssh") is not None, "the OpenSSH client is not installed")
    marker = "run-output-7f3a"
    started = _in_container(
        real_parts,
        *("tmux", "-L", "dflash", "new-session", "-d", "-s", ssh_host.session),
        *("-x", "100", "-y", "20", f"echo {marker}; exec sleep 600"),
    )
    assert started.returncode == 0, started.stderr
    term = Terminal(f"dflash-attach-test-{os.getpid()}", width=100, height=24)
    inventory = ssh_host.known_hosts.parent / "hosts.toml"
    try:
        term.start(
            [sys.executable, "-m", "dflashctl", "--hosts", str(inventory), "attach", "ct"],
            {"TERM": "xterm-dflash-unknown"},  # no terminfo: attach falls back
        )
        screen = term.wait(
            "attach to show the session or exit", lambda t: marker in t or "exit=" in t
        )
        assert marker in screen and "exit=" not in screen, screen  # e.g. tmux refused the $TERM
        term.keys("C-b", "d")  # tmux's detach key, typed into the attached client
        screen = term.wait("ssh to return after the detach", lambda t: "exit=" in t)
        assert "[detached (from session" in screen and "exit=0" in screen
    finally:
        term.kill()
    alive = _in_container(
        real_parts, "tmux", "-L", "dflash", "has-session", "-t", f"={ssh_host.session}"
    )
    assert alive.returncode == 0, "detaching ended the run's session"
