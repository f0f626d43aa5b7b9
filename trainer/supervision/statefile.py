"""RUN/supervisor.json: written only by the supervisor, whole, by rename (readers never see half).

The trainer rewrites RUN/run-state.json whole on each update; a second writer there would race it
(read, merge, rename: the later rename drops the other's fields). One owner per file avoids it.

When the file cannot be written (RUN's disk is full) it goes on saying an older state, so the
supervisor says the truth where it can still be read: a `state_stale` phase line on its pane
(`StateFile`), each time what it is changes, and its exit status once it ends.
"""

from __future__ import annotations

import errno
import json
import os
import time
from pathlib import Path
from typing import Any

from trainer.config.policy import Policy
from trainer.events import StaleState, format_state_stale
from trainer.supervision.console import Console

SUPERVISOR_STATE = "supervisor.json"
SCHEMA_VERSION = 1
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def initial_state(
    policy: Policy, argv: list[str], restarts: list[dict[str, Any]]
) -> dict[str, Any]:
    """The supervisor's state before its first attempt (`restarts`: the list its restart
    history appends to, shared)."""
    return {
        "pid": os.getpid(),
        "started_at": now_iso(),
        "policy": policy.as_json(),
        "argv": argv,
        "state": "starting",
        "attempt": 0,
        "trainer_pid": None,
        "restarts": restarts,
        "gave_up": False,
        "detail": None,
        "exit_status": None,
        "low_disk": None,  # {free_mib, needed_mib, path, holds, since, ...} while low
        "low_disks": [],  # every low filesystem's entry
    }


def write_state(run_dir: Path, state: dict[str, Any]) -> OSError | None:
    """Write the state by temp file + rename; returns the error instead of raising."""
    path = run_dir / SUPERVISOR_STATE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    blob = json.dumps({**state, "version": SCHEMA_VERSION, "updated_at": now_iso()}, indent=2)
    try:
        with open(tmp, "w") as fh:
            fh.write(blob + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return exc
    return None


class StateFile:
    """RUN/supervisor.json, and the pane line that stands in for it while it cannot be written."""

    def __init__(self, run_dir: Path, console: Console) -> None:
        self.path = run_dir / SUPERVISOR_STATE
        self.run_dir, self.console = run_dir, console
        self._said: StaleState | None = None  # the truth last said on the pane instead

    def write(self, state: dict[str, Any]) -> None:
        """Write `state`; when that fails, say what the file no longer does (once per change of
        state, attempt, exit status or detail: not for every low-disk update)."""
        err = write_state(self.run_dir, state)
        if err is None:
            self._said = None
            return
        why = err.strerror or str(err)
        if err.errno in _DISK_FULL:
            why += ": the disk is full"
        status = state.get("exit_status")
        stale = StaleState(
            path=str(self.path),
            why=why,
            state=str(state.get("state")),
            attempt=int(state.get("attempt") or 0),
            exit_status=status if isinstance(status, int) else None,
            detail=str(state.get("detail") or ""),
        )
        if stale != self._said:
            self.console.say(format_state_stale(stale), status_log=True)
            self._said = stale


def read_state(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / SUPERVISOR_STATE).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def read_trainer_record(run_dir: Path, pid: int) -> tuple[str | None, int | None]:
    """(`state`, `exit_status`) of RUN/run-state.json when process `pid` wrote it or is the
    writer's parent (torchrun between the supervisor and rank 0), else (None, None)."""
    try:
        data = json.loads((run_dir / "run-state.json").read_text())
    except (OSError, ValueError):
        return None, None
    if not isinstance(data, dict) or pid not in (data.get("pid"), data.get("parent_pid")):
        return None, None
    state, status = data.get("state"), data.get("exit_status")
    return (
        state if isinstance(state, str) else None,
        status if isinstance(status, int) and not isinstance(status, bool) else None,
    )
