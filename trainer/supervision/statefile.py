"""RUN/supervisor.json: written only by the supervisor, whole, by rename (readers never see half).

The trainer rewrites RUN/run-state.json whole on each update; a second writer there would race it
(read, merge, rename: the later rename drops the other's fields). One owner per file avoids it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

SUPERVISOR_STATE = "supervisor.json"
SCHEMA_VERSION = 1


def now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def write_state(run_dir: Path, state: dict[str, Any]) -> str | None:
    """Write the state by temp file + rename; returns a one-line problem instead of raising."""
    path = run_dir / SUPERVISOR_STATE
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    blob = json.dumps({**state, "version": SCHEMA_VERSION, "updated_at": now_iso()}, indent=2)
    try:
        with open(tmp, "w") as fh:
            fh.write(blob + "\n")
        os.replace(tmp, path)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        return f"{path}: cannot write: {exc.strerror or exc}"
    return None


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
