"""The stall watchdog's stop of a trainer that made no progress: a /proc snapshot, SIGCONT when
it is stopped, its thread stacks (SIGUSR1, faulthandler) into console.log, SIGINT, and SIGKILL
when it is still alive `kill_grace_s` later.
"""

from __future__ import annotations

import os
import signal

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
