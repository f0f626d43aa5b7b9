"""A detached job as its status script reports it (`dflashctl.remote.jobs`): the pure parser and
what a job that ended without a result is. No I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.remote.jobs import JobKind
from dflashctl.remote.tmux import PaneState
from dflashctl.runs.detached import DetachedRecord, parse_status
from dflashctl.runs.detached import error_line as detached_error_line
from dflashctl.runs.detached import outcome_error as detached_outcome_error

JOB_STATES = ("none", "running", "finished", "failed", "cancelled", "lost")
SAID = ("error: ", "gate FAILED ")
"""The lines that say why a job did not finish (the last one is its error line)."""


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
class JobState(DetachedRecord):
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
    def record_id(self) -> str | None:
        return self.job_id

    def subdir(self, record_id: str) -> str:
        return self.kind.dir(record_id)

    @property
    def name(self) -> str:
        """`gate 20261201T170211Z`."""
        return f"{self.kind.name} {self.job_id}"


def parse_job_status(host: str, kind: JobKind, workdir: str, stdout: str) -> JobState:
    """JobState from `remote.jobs.status_argv`'s output (pure). Remote text is sanitised here."""
    s = parse_status(stdout)
    if s is None:
        return JobState(host=host, kind=kind, workdir=workdir)
    return JobState(
        host=host,
        kind=kind,
        job_id=s.record_id,
        state=s.state,
        exit_status=s.exit_status,
        now=s.now,
        output=s.lines("output"),
        info=s.info,
        key=s.sections.get("key", "").strip() or None,
        has_result=s.flag("result"),
        release=s.release,
        runnable=s.flag("runnable"),
        pane=s.pane,
        cancelled_at=s.cancelled_at,
        workdir=workdir,
    )


def error_line(output: Sequence[str], exit_status: int | None) -> str:
    """What a job that did not finish said last: its `error: ` line (without the prefix) or
    the gate's `gate FAILED ...` line, else its last line, else its exit status."""
    return detached_error_line(output, exit_status, SAID)


def outcome_error(st: JobState, output: Sequence[str]) -> JobError | None:
    """The error a job that ended badly is, from all of its output lines (None: it finished,
    or it failed with a result the caller reads: exit 1 with result.json)."""
    what, refused = f"{st.host}: {st.name}", f"{st.host}: {st.kind.module}"
    return detached_outcome_error(st, output, what, refused, (JobError, JobRefused), SAID)
