"""The stall watchdog's stop of a trainer that made no progress: a /proc snapshot, SIGCONT when
it is stopped, its thread stacks (SIGUSR1, faulthandler) into console.log, SIGINT, and SIGKILL
when it is still alive `kill_grace_s` later.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

from trainer.supervision import procinfo
from trainer.supervision.child import Child, wait_exit
from trainer.supervision.console import PREFIX, Console


def stop_stalled(
    child: Child, idle_s: float, limit: float, kill_grace_s: float, console: Console
) -> None:
    pid = child.pid
    console.say(
        f"{PREFIX}trainer pid {pid} made no progress in status.log for {idle_s:.0f} s "
        f"(limit {limit:g} s): /proc snapshot, thread stacks, then SIGINT"
    )
    for line in procinfo.snapshot(pid):
        console.say(f"{PREFIX}{line}")
    if procinfo.is_stopped(pid):
        console.say(f"{PREFIX}pid {pid} is stopped (SIGSTOP): sending SIGCONT so it can dump")
        os.kill(pid, signal.SIGCONT)
    if procinfo.catches(pid, signal.SIGUSR1):
        console.say(f"{PREFIX}thread stacks of pid {pid} (faulthandler, SIGUSR1) follow")
        os.kill(pid, signal.SIGUSR1)
        wait_exit(child, 1.0)
    else:
        console.say(f"{PREFIX}no stack dump: pid {pid} has no SIGUSR1 handler (faulthandler)")
    if child.poll() is None:
        os.kill(pid, signal.SIGINT)
        if not wait_exit(child, kill_grace_s):
            console.say(f"{PREFIX}pid {pid} still alive {kill_grace_s:g} s after SIGINT: SIGKILL")
            child.kill()
            child.wait()


def kill_stalled_ranks(
    pids: list[int], idle_s: float, limit: float, kill_grace_s: float, console: Console
) -> None:
    """A group node's stalled ranks (the agent's workers, not our children): a /proc snapshot
    and the thread stacks of each, then SIGKILL. No graceful SIGINT: a rank of a group that
    makes no progress is held in a collective, and its stop would need that collective; the
    group resumes from node 0's newest checkpoint instead."""
    console.say(
        f"{PREFIX}ranks {', '.join(map(str, pids)) or '(none)'} made no progress in status.log "
        f"for {idle_s:.0f} s (limit {limit:g} s): /proc snapshot, thread stacks, then SIGKILL"
    )
    dumped = False
    for pid in pids:
        for line in procinfo.snapshot(pid):
            console.say(f"{PREFIX}{line}")
        if procinfo.is_stopped(pid):
            console.say(f"{PREFIX}pid {pid} is stopped (SIGSTOP): sending SIGCONT so it can dump")
            _signal(pid, signal.SIGCONT)
        if procinfo.catches(pid, signal.SIGUSR1):
            console.say(f"{PREFIX}thread stacks of pid {pid} (faulthandler, SIGUSR1) follow")
            _signal(pid, signal.SIGUSR1)
            dumped = True
    if dumped:
        deadline = time.monotonic() + min(1.0, kill_grace_s)
        while time.monotonic() < deadline and not all(procinfo.gone(p) for p in pids):
            time.sleep(0.05)
    for pid in pids:
        _signal(pid, signal.SIGKILL)


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
