"""A group node's stop ends a torchrun left without ranks (`control.kill_if_childless`).

torchrun whose ranks have exited can sit at its exit barrier (a peer's agent failed) and ignore
the session's SIGHUP, holding the rendezvous port: `RunStopper.stop_node` SIGKILLs it once it
has no children, and never while a rank lives. Real process trees, no mocks: a stand-in
torchrun (a Python parent that ignores SIGINT and SIGHUP, waits for its rank, then waits
forever) and its rank (checkpoints on SIGINT and exits), in a real tmux session through
LocalTransport; and the kill argv alone, run against a parent with and without a child.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from dflashctl.config.inventory import local_host
from dflashctl.remote import LocalTransport
from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.tmux import tmux_new_session
from dflashctl.runs.control import RunControl
from dflashctl.runs.stopper import kill_if_childless
from tests import budget
from tests.conftest import require_part
from trainer.events.lifecycle import format_checkpoint_line

# argv: status.log, its checkpoint line. The rank: on SIGINT that line, then exit 0.
RANK = """
import signal, sys, time
def stop(*_):
    with open(sys.argv[1], "a") as log:
        log.write(sys.argv[2] + "\\n")
    sys.exit(0)
signal.signal(signal.SIGINT, stop)
while True:
    time.sleep(0.05)
"""
# argv: pid file, the rank's program, its arguments. torchrun stuck at its exit barrier once
# its rank is gone: the stop's SIGINT is for the ranks (dflashctl never signals torchrun), the
# session's SIGHUP is ignored.
TORCHRUN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGINT, signal.SIG_IGN)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
rank = subprocess.Popen([sys.executable, "-c", *sys.argv[2:]])
with open(sys.argv[1] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {rank.pid}")
os.rename(sys.argv[1] + ".tmp", sys.argv[1])
rank.wait()
while True:
    time.sleep(1)
"""


def gone(pid: int) -> bool:
    """Not running (exited and reaped, or a zombie waiting for its parent)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def wait_until(cond: Callable[[], bool]) -> bool:
    """Whether `cond` came true within the test's one budget."""
    try:
        budget.until(cond)
    except budget.BudgetSpent:
        return bool(cond())
    return True


def end_processes(pids: list[int]) -> None:
    """The test's own processes, by id, if the code under test left them."""
    for pid in pids:
        if not gone(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def need_pgrep() -> None:
    require_part(shutil.which("pgrep") is not None, "pgrep (procps) not installed")


@pytest.fixture
async def ctl(tmp_path: Path, need_pgrep: None) -> AsyncIterator[RunControl]:
    require_part(shutil.which("tmux") is not None, "tmux not installed")
    sock = tmp_path / "tmux"
    sock.mkdir()
    transport = LocalTransport(env={"TMUX_TMPDIR": str(sock)})
    host = local_host("loc", tmp_path / "wd", python=sys.executable, session="t")
    yield RunControl(transport, host)
    await transport.run(["tmux", "-L", "dflash", "kill-server"])
    await transport.close()


@pytest.mark.timeout(120)
async def test_a_node_stop_kills_the_torchrun_its_ranks_left(
    ctl: RunControl, tmp_path: Path
) -> None:
    layout = RemoteLayout(ctl.host.workdir)
    log = Path(layout.status_log)
    log.parent.mkdir(parents=True)
    log.touch()
    pids_file = tmp_path / "pids"
    line = format_checkpoint_line(7, str(Path(layout.run_dir) / "checkpoints/step-00000007.pt"))
    fake = [sys.executable, "-c", TORCHRUN, str(pids_file), RANK, str(log), line]
    started = await ctl.transport.run(
        tmux_new_session(ctl.host.session, fake, cwd=ctl.host.workdir, env={})
    )
    assert started.ok, started.error_line()
    assert wait_until(pids_file.exists), "the stand-in torchrun did not start its rank"
    torchrun, rank = (int(x) for x in pids_file.read_text().split())
    try:
        assert (await ctl.status()).state == "running"
        stopped = await ctl.stopper.stop_node(budget.left(), settle_s=1.0)
        # the rank checkpointed and exited; torchrun did not exit by itself within settle_s
        assert stopped.was_running and stopped.outcome == "checkpointed", stopped
        assert stopped.checkpoint is not None and stopped.checkpoint.step == 7, stopped
        assert gone(rank)
        assert wait_until(lambda: gone(torchrun)), "torchrun outlived its ranks' stop"
        assert (await ctl.status()).state == "stopped"  # the session is gone too
    finally:
        end_processes([rank, torchrun])


def _parent_with_child(tmp_path: Path) -> tuple[subprocess.Popen[str], int]:
    """A parent that ignores SIGHUP/SIGINT, reaps its child when it exits, and stays."""
    pids_file = tmp_path / "pids"
    child = "import time\nwhile True: time.sleep(0.05)"
    parent = subprocess.Popen([sys.executable, "-c", TORCHRUN, str(pids_file), child], text=True)
    assert wait_until(pids_file.exists), "the parent did not start its child"
    return parent, int(pids_file.read_text().split()[1])


@pytest.mark.timeout(60)
def test_the_kill_spares_a_parent_with_a_live_child_and_ends_a_childless_one(
    tmp_path: Path, need_pgrep: None
) -> None:
    parent, child = _parent_with_child(tmp_path)
    try:
        spared = subprocess.run(
            kill_if_childless(parent.pid), capture_output=True, timeout=budget.left()
        )
        assert spared.returncode != 0  # pgrep found the rank: nothing killed
        time.sleep(0.3)
        assert parent.poll() is None and not gone(child)
        os.kill(child, signal.SIGKILL)  # the rank goes; its parent reaps it and stays
        assert wait_until(lambda: gone(child) and not Path(f"/proc/{child}").exists())
        assert parent.poll() is None
        killed = subprocess.run(
            kill_if_childless(parent.pid), capture_output=True, timeout=budget.left()
        )
        assert killed.returncode == 0, killed
        assert budget.wait(parent, "the childless parent killed") == -signal.SIGKILL
    finally:
        end_processes([child])
        if parent.poll() is None:
            parent.kill()
        parent.wait()
