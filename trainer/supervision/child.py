"""The trainer as the supervisor's child: spawned in its own session (a Ctrl-C in the pane
reaches it exactly once, forwarded) with SIGTERM as its parent-death signal, waited for with a
deadline, and sent the signals the supervisor receives.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time

TICK_S = 0.1
"""How often the supervisor looks at its child (and the clock) while it waits."""

Child = subprocess.Popen[bytes]


def _set_parent_death_signal() -> None:
    # Runs in the child before exec: if the supervisor is SIGKILLed, the trainer gets SIGTERM
    # (a graceful stop) instead of running on orphaned, outside the tmux session.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


def spawn(
    argv: list[str], *, pipe_stderr: bool = False, env: dict[str, str] | None = None
) -> Child:
    """Start the trainer in its own session; OSError when it cannot be started.
    `pipe_stderr`: its stderr is a pipe (a group node's torchrun, read by `agent.AgentTee`)."""
    return subprocess.Popen(
        argv,
        start_new_session=True,
        preexec_fn=_set_parent_death_signal,
        stderr=subprocess.PIPE if pipe_stderr else None,
        env=env,
    )


def become_subreaper() -> None:
    """Orphans of our descendants become our children (PR_SET_CHILD_SUBREAPER): a torchrun
    agent killed outright leaves its workers (each in a session of its own) to us, and the
    supervisor ends them before it starts another agent."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def end_orphans() -> list[int]:
    """SIGKILL and reap every child of ours (see `become_subreaper`): the workers of an agent
    that died. Not a graceful stop: a worker whose agent is gone must not go on training with
    the other nodes (nor stop them through the step's reduce); it fails, so their collectives
    fail and their agents restart the group, which this node rejoins with a new agent."""
    from trainer.supervision.procinfo import children

    pids = children(os.getpid())
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    for pid in pids:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
    return pids


def wait_exit(child: Child, seconds: float) -> bool:
    """Wait up to `seconds` for the child to exit; True when it did."""
    deadline = time.monotonic() + seconds
    while child.poll() is None:
        if time.monotonic() >= deadline:
            return False
        time.sleep(min(TICK_S, max(0.0, deadline - time.monotonic())))
    return True


def forward(child: Child | None, signum: int) -> None:
    """Pass a received signal on to the child (safe inside a signal handler)."""
    # returncode, not poll(): no reaping inside a handler. Until the child is reaped its pid
    # cannot be reused, so the kill reaches the child or its zombie.
    if child is not None and child.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, signum)  # one per signal received: the child has its own pgrp
            os.kill(child.pid, signal.SIGCONT)  # a SIGSTOPped child must see it too
