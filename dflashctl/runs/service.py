"""What one host's run service is: its protocol, its results and its errors (no I/O).

`RunControl` (dflashctl.runs.control) implements `RunService` over a Transport; the monitor,
the TUI, the CLI and their test doubles use only this protocol and these results.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.gpus.nvidia_smi import GpuSample
from dflashctl.releases.deploy import DeployResult
from dflashctl.releases.release import Release
from dflashctl.remote.commands import SUPERVISOR_MODULE
from dflashctl.remote.layout import SUPERVISOR_SOURCE as SUPERVISOR_FILE
from dflashctl.runs.follow import FollowEvent
from dflashctl.runs.snapshot import RunningJob, RunningMeasure, RunStatus
from trainer.events import CheckpointEvent

if TYPE_CHECKING:
    from dflashctl.releases.resume import CheckpointConfig

FOLLOW_JITTER = 0.2
"""`follow`'s reconnect delays vary by +-20 %, so many clients of one host do not reconnect in
step."""
DEFAULT_START_WAIT_S = 120.0
"""How long start/restart wait for the trainer's setup (or its exit); hosts.toml start_wait."""
LIVE_STATES = frozenset({"running", "restarting", "stalled", "rendezvous"})
"""States whose pane process (the supervisor, or an unsupervised trainer) is alive: stop acts,
start is a no-op. restarting: the trainer died and the supervisor waits out its backoff;
stalled: the watchdog is stopping a trainer that made no progress."""


class ControlError(DflashctlError):
    """A run-control operation failed (one line naming the host)."""

    exit_code = ExitCode.FAILED


class StartFailed(ControlError):
    """The trainer exited right after it was started (exit status and its last error line)."""


class MeasureInProgress(ControlError):
    """A start refused while `dflashctl measure` runs on the host (both would use its devices)."""


class JobInProgress(ControlError):
    """A start refused while `dflashctl eval` or `gate` runs on the host (its devices)."""


@dataclass(frozen=True)
class StartResult:
    host: str
    started: bool  # False: it was already running
    release: str
    pane_pid: int | None
    argv: list[str]
    ready: bool | None = None  # past setup (a phase line); False: still starting after wait_s
    waited_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def supervised(self) -> bool:
        """Under the in-container supervisor (the release ships it; older ones run bare)."""
        return SUPERVISOR_MODULE in self.argv

    def supervisor_note(self) -> str | None:
        """What an unsupervised start means, for people; None when supervised."""
        if self.supervised or not self.started:
            return None
        return (
            f"release {self.release} has no {SUPERVISOR_FILE}: the trainer runs without its "
            f"supervisor (no restart on failure, no stall watchdog); deploy a newer tree"
        )


@dataclass(frozen=True)
class StopResult:
    host: str
    was_running: bool
    checkpoint: CheckpointEvent | None
    outcome: str  # exited | checkpointed | timeout | not-running | dead
    exit_status: int | None = None
    error: str | None = None  # the trainer's own error line after the interrupt, if any
    in_backoff: bool = False  # the supervisor was between attempts: no trainer was running

    @property
    def saved(self) -> bool:
        """The stop lost nothing: its checkpoint line was seen, the trainer exited 0 (nothing
        unsaved), or no trainer was running (a restart backoff). A stop that was not needed
        (not running) counts as saved."""
        if not self.was_running or self.in_backoff or self.checkpoint is not None:
            return True
        return self.outcome == "exited" and self.exit_status == 0

    def summary(self) -> str:
        """What stop found and did, for people (the CLI and the demo print it)."""
        if not self.was_running:
            if self.exit_status is None:
                return "not running"
            return f"not running: the run had already exited with status {self.exit_status}"
        ck = self.checkpoint
        if ck:
            return f"stopped ({self.outcome}); checkpoint step {ck.step} at {ck.path}"
        if self.in_backoff:
            return f"stopped ({self.outcome}); it was in a restart backoff: nothing unsaved"
        if self.saved:
            return f"stopped ({self.outcome}); the trainer exited 0: nothing unsaved"
        status = f", exit status {self.exit_status}" if self.exit_status is not None else ""
        why = self.error or "no checkpoint line seen"
        return f"stopped ({self.outcome}{status}); its checkpoint was NOT written: {why}"


@dataclass(frozen=True)
class RestartResult:
    host: str
    deploy: DeployResult
    stop: StopResult
    start: StartResult
    config_diff: str
    old_config_hash: str | None
    new_config_hash: str | None


class RunService(Protocol):
    """What the monitor, the TUI, the CLI and their test doubles use of one host's run.

    `RunControl` is the implementation over a Transport; doubles (tests, replays) implement the
    same signatures. `tail_log` is one connection's stream (it ends, or raises TransportError,
    when that link drops); the reconnecting loop around it lives in `dflashctl.runs.follow`.
    """

    async def status(self, *, setup_errors: bool = False) -> RunStatus: ...

    async def deployed_config(self) -> str: ...

    async def checkpoint_config(self, resume: str = "auto") -> CheckpointConfig | None: ...

    async def gpus(self) -> list[GpuSample]: ...

    async def start(
        self,
        *,
        fresh: bool = False,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Callable[[str], None] | None = None,
    ) -> StartResult: ...

    async def stop(self, timeout: float = 120.0) -> StopResult: ...

    async def restart(
        self,
        fresh: bool = False,
        *,
        config: Path | None = None,
        stop_timeout: float = 120.0,
        progress: Callable[[str], None] | None = None,
        release: Release | None = None,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
    ) -> RestartResult: ...

    def tail_log(self, from_line: int) -> AsyncIterator[str]: ...

    async def log_line_count(self) -> int | None: ...

    def follow(
        self,
        from_line: int = 0,
        *,
        delay: Callable[[int], float] | None = None,
        max_attempts: int | None = None,
    ) -> AsyncGenerator[FollowEvent, None]: ...


# --- pure builders and parsers -------------------------------------------------------------


def measure_refusal(
    m: RunningMeasure, name: str, what: str = "a training run"
) -> MeasureInProgress:
    """Why `what` does not start on host `name` while measure `m` runs there (one line: the
    host, the measure's id and since when, how to see and stop it)."""
    return MeasureInProgress(
        f"{name}: measure {m.id} is running there (since {m.since}, tmux session "
        f"{m.session!r}): {what} would share its devices; `dflashctl measure {name} --result` "
        f"shows how far it is, `dflashctl measure {name} --stop` ends it"
    )


def job_refusal(j: RunningJob, name: str, what: str = "a training run") -> JobInProgress:
    """Why `what` does not start on host `name` while job `j` (an eval or a gate) runs there."""
    return JobInProgress(
        f"{name}: {j.kind} {j.id} is running there (since {j.since}, tmux session "
        f"{j.session!r}): {what} would share its devices; `dflashctl {j.kind} {name} --result` "
        f"shows how far it is, `dflashctl {j.kind} {name} --stop` ends it"
    )


TORCHRUN_SHUTDOWN_TIMEOUT_S = 600
"""How long torchrun waits for its ranks after forwarding a stop before it SIGKILLs them."""
