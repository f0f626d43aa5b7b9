"""A detached job as its status script reports it (`dflashctl.remote.jobs`): the pure parser and
what a job that ended without a result is. No I/O."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.humanize import format_age
from dflashctl.remote.jobs import JobKind
from dflashctl.remote.layout import MEASURE_ID_PATTERN
from dflashctl.remote.tmux import PaneState, parse_pane_state
from dflashctl.runs.snapshot import iso_utc, measure_started, split_sections
from trainer.events import sanitize_for_terminal

JOB_STATES = ("none", "running", "finished", "failed", "cancelled", "lost")


class JobError(DflashctlError):
    """A job that failed, ended without a result, or cannot run now (one line, the host)."""

    exit_code = ExitCode.FAILED


class JobRefused(JobError):
    """The job's module refused what it was asked (its own exit 2): its line, the host named."""

    exit_code = ExitCode.USAGE


class JobBusy(JobError):
    """The host runs training, a measure or another job: this one would share the devices."""


class JobRunning(JobError):
    """`--result` while the job still runs: how far it is."""


@dataclass(frozen=True)
class JobState:
    """The newest job of a kind on a host (or one asked for by id); `output` holds its output
    lines from the line asked for on (made safe to print)."""

    host: str
    kind: JobKind
    job_id: str | None = None
    state: str = "none"  # one of JOB_STATES
    exit_status: int | None = None
    now: float | None = None  # the host's clock
    output: list[str] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)
    key: str | None = None  # `<release> <config sha256>` when it started
    has_result: bool = False
    release: str | None = None  # what `current` points at now
    runnable: bool = False  # `current` ships the kind's source
    pane: PaneState | None = None
    cancelled_at: str | None = None
    workdir: str = ""

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def started(self) -> float | None:
        return measure_started(self.job_id) if self.job_id else None

    def age(self) -> float | None:
        t = self.started
        return None if t is None or self.now is None else max(0.0, self.now - t)

    def since(self) -> str:
        """`since 2026-12-01 17:02:11 UTC, 3m10s ago`."""
        t, age = self.started, self.age()
        if t is None:
            return "since an unknown time"
        return f"since {iso_utc(t)}" + (f", {format_age(age)} ago" if age is not None else "")

    @property
    def directory(self) -> str:
        return f"{self.workdir}/{self.kind.dir(self.job_id or '?')}"

    @property
    def name(self) -> str:
        """`gate 20261201T170211Z`."""
        return f"{self.kind.name} {self.job_id}"


def parse_job_status(host: str, kind: JobKind, workdir: str, stdout: str) -> JobState:
    """JobState from `remote.jobs.status_argv`'s output (pure). Remote text is sanitised here."""
    raw = split_sections(stdout)
    if "noworkdir" in raw:
        return JobState(host=host, kind=kind, workdir=workdir)
    s = {k: sanitize_for_terminal(v) for k, v in raw.items()}
    jid = s.get("id", "").strip()
    if not re.match(MEASURE_ID_PATTERN, jid):
        jid = ""
    pane = parse_pane_state(s.get("pane", ""))
    exit_text = s.get("exit", "").strip()
    exit_status = int(exit_text) if re.fullmatch(r"-?\d+", exit_text) else None
    info: dict[str, Any] = {}
    try:
        loaded = json.loads(s.get("info", "") or "{}")
        info = loaded if isinstance(loaded, dict) else {}
    except json.JSONDecodeError:
        pass
    cancelled = s.get("cancelled", "").strip() or None
    if not jid:
        state = "none"
    elif exit_status is not None:
        state = "finished" if exit_status == 0 else "cancelled" if cancelled else "failed"
    elif pane is not None and not pane.dead:
        state = "running"
    else:
        state = "cancelled" if cancelled else "lost"
    output = s.get("output", "")
    now_text = s.get("now", "").strip()
    current = s.get("current", "").strip()
    return JobState(
        host=host,
        kind=kind,
        job_id=jid or None,
        state=state,
        exit_status=exit_status,
        now=float(now_text) if now_text.isdigit() else None,
        output=output.splitlines() if output.strip() else [],
        info=info,
        key=s.get("key", "").strip() or None,
        has_result=s.get("result", "").strip() == "yes",
        release=current.rsplit("/", 1)[-1] if current else None,
        runnable=s.get("runnable", "").strip() == "yes",
        pane=pane,
        cancelled_at=cancelled,
        workdir=workdir,
    )


def error_line(output: Sequence[str], exit_status: int | None) -> str:
    """What a job that did not finish said last: its `error: ` line (without the prefix) or
    the gate's `gate FAILED ...` line, else its last line, else its exit status."""
    lines = [ln.strip() for ln in output if ln.strip()]
    said = [ln for ln in lines if ln.startswith(("error: ", "gate FAILED "))]
    if said:
        return said[-1].removeprefix("error: ")
    if lines:
        return lines[-1]
    return f"exit status {exit_status}" if exit_status is not None else "it printed nothing"


def outcome_error(st: JobState, output: Sequence[str]) -> JobError | None:
    """The error a job that ended badly is, from all of its output lines (None: it finished,
    or it failed with a result the caller reads: exit 1 with result.json)."""
    if st.state == "finished":
        return None
    if st.state == "failed" and st.exit_status == 2:
        return JobRefused(f"{st.host}: {st.kind.module}: {error_line(output, 2)}")
    if st.state == "failed":
        how = "failed" if st.exit_status == 1 else f"exited with status {st.exit_status}"
        return JobError(f"{st.host}: {st.name} {how}: {error_line(output, st.exit_status)}")
    if st.state == "cancelled":
        return JobError(f"{st.host}: {st.name} was stopped ({st.cancelled_at}) before it finished")
    if st.state == "lost":
        return JobError(
            f"{st.host}: {st.name} ended without a result (no exit status, no live session: "
            f"the container restarted or the session was killed); last: "
            f"{error_line(output, None)}"
        )
    return None
