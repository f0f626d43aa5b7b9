"""Run control: start, stop, restart, status, follow, GPUs — over any Transport.

The trainer runs in tmux on a private socket (`-L dflash`), session name from the inventory,
exact-match targets, remain-on-exit (a crash leaves a dead pane with its exit status). It is
started against a resolved release directory, not the `current` symlink, so a deploy while it
runs never swaps code under it; `run/.release` records which release that is (deploy never
prunes it).
"""

from __future__ import annotations

import asyncio
import re
import signal
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

from dflashctl.deploy import (
    DeployResult,
    deploy,
    push_config_file,
    switch_note,
)
from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.follow import Backoff, FollowEvent, LogFollower
from dflashctl.gpu_health import (
    LEGACY_REASONS_PREFIX,
    REASONS_PREFIX,
    GpuHealth,
    health_fields,
    health_query_argv,
    parse_health_csv,
    unknown_query_field,
)
from dflashctl.inventory import NAME_RE, HostConfig, InventoryError
from dflashctl.launch import NodeLaunch
from dflashctl.release import Release
from dflashctl.remote.commands import SUPERVISOR_MODULE, guarded, supervised
from dflashctl.remote.files import line_count, read_file, tail_follow, tail_from, write_file_atomic
from dflashctl.remote.layout import (
    CONFIG,
    MEASURE_ID_FORMAT,
    MEASURE_ID_PATTERN,
    STATUS_LOG,
    RemoteLayout,
    measure_session,
)
from dflashctl.remote.layout import RUN_STATE as RUN_STATE_FILE
from dflashctl.remote.layout import SUPERVISOR_SOURCE as SUPERVISOR_FILE
from dflashctl.remote.layout import SUPERVISOR_STATE as SUPERVISOR_STATE_FILE
from dflashctl.remote.release import acknowledge_switch
from dflashctl.remote.run import MARK as MARK
from dflashctl.remote.run import STATUS_SCRIPT as STATUS_SCRIPT
from dflashctl.remote.run import (
    TORCHRUN_MODULE,
    gpu_query_argv,
    host_trainer_argv,
    start_wait_argv,
    status_argv,
)
from dflashctl.remote.run import stop_wait_argv as stop_wait_argv
from dflashctl.remote.run import trainer_argv as trainer_argv
from dflashctl.remote.tmux import (
    PaneState,
    parse_pane_state,
    tmux_capture,
    tmux_interrupt,
    tmux_kill_session,
    tmux_new_session,
    tmux_settled_pane_state,
)
from dflashctl.remote.transport import (
    CommandResult,
    CommandTimeout,
    HostUnreachable,
    Transport,
    TransportError,
)
from trainer.events import (
    CheckpointEvent,
    ErrorEvent,
    Event,
    PhaseEvent,
    StatusEvent,
    parse_line,
    sanitize_for_terminal,
)
from trainer.events.run_state import RunState, parse_run_state, read_json_object

if TYPE_CHECKING:
    from dflashctl.resume import CheckpointConfig

FOLLOW_JITTER = 0.2
"""`follow`'s reconnect delays vary by +-20 %, so many clients of one host do not reconnect in
step."""
DEFAULT_START_WAIT_S = 120.0
"""How long start/restart wait for the trainer's setup (or its exit); hosts.toml start_wait."""
LIVE_STATES = frozenset({"running", "restarting", "stalled"})
"""States whose pane process (the supervisor, or an unsupervised trainer) is alive: stop acts,
start is a no-op. restarting: the trainer died and the supervisor waits out its backoff;
stalled: the watchdog is stopping a trainer that made no progress."""
SUPERVISOR_KEYS = (
    "state",
    "gave_up",
    "attempt",
    "trainer_pid",
    "detail",
    "exit_status",
    "policy",
    "low_disk",  # {free_mib, needed_mib, checkpoint_mib, checkpoints, since}: less free than retention keeps
)


class ControlError(DflashctlError):
    """A run-control operation failed (one line naming the host)."""

    exit_code = ExitCode.FAILED


class StartFailed(ControlError):
    """The trainer exited right after it was started (exit status and its last error line)."""


class MeasureInProgress(ControlError):
    """A start refused while `dflashctl measure` runs on the host (both would use its devices)."""


def measure_started(measure_id: str) -> float | None:
    """Epoch seconds of a measure id (its UTC start); None for what is not one."""
    try:
        return datetime.strptime(measure_id, MEASURE_ID_FORMAT).replace(tzinfo=UTC).timestamp()
    except ValueError:
        return None


def iso_utc(epoch: float) -> str:
    """`2026-12-01 17:02:11 UTC`."""
    return datetime.fromtimestamp(epoch, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@dataclass(frozen=True)
class RunningMeasure:
    """The measure running on a host, as status reads it in its round trip (none: None)."""

    id: str
    session: str  # its tmux session (the host's session + `-measure`)
    since: str  # its start, `2026-12-01 17:02:11 UTC` (the id is its UTC start)
    age_s: float | None = None  # seconds since, by the host's clock
    progress: str | None = None  # its last progress line (made safe to print)


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    util_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    temp_c: float | None
    power_w: float | None


@dataclass(frozen=True)
class RunStatus:
    host: str
    state: str  # running | restarting | stalled | stopped | crashed | gave-up | unreachable
    exit_status: int | None = None
    release: str | None = None  # what `current` points at (deployed)
    run_release: str | None = None  # what the trainer was started from
    config_hash: str | None = None  # of the running/last run (run-state.json)
    deployed_config_hash: str | None = None  # of run/config.toml now
    last_event: StatusEvent | None = None
    last_checkpoint: CheckpointEvent | None = None
    last_error: str | None = None
    log_lines: int = 0
    run_state: RunState = field(default_factory=RunState)
    pane_tail: list[str] = field(default_factory=list)
    message: str | None = None
    signal: str | None = None  # the signal that ended the pane's process ("SIGKILL")
    stop_signal: str | None = None  # the signal the trainer stopped on (run-state.json)
    run_state_error: str | None = None  # run-state.json exists but cannot be read
    switch_note: str | None = None  # a deploy switched `current` and never reported back
    # the in-container supervisor of the pane's run (RUN/supervisor.json, only when its pid is
    # the pane's): policy, state, gave_up, attempt, trainer_pid, detail, exit_status, restarts
    supervisor: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)
    supervisor_error: str | None = None  # supervisor.json exists but cannot be read
    release_has_supervisor: bool = False  # `current` ships trainer/supervise.py
    measure: RunningMeasure | None = None  # a `dflashctl measure` running there now

    @property
    def step(self) -> int | None:
        return self.last_event.step if self.last_event else None

    @property
    def finished(self) -> bool:
        """Stopped because the plan is complete (the trainer said so), not by an operator."""
        return run_finished(self.state, self.exit_status, self.run_state)

    def to_json_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["last_event"] = self.last_event.model_dump() if self.last_event else None
        d["last_checkpoint"] = self.last_checkpoint.model_dump() if self.last_checkpoint else None
        # the file's keys as read (extras included), not the model's defaults
        d["run_state"] = self.run_state.model_dump(mode="json", exclude_unset=True)
        d["step"] = self.step
        d["finished"] = self.finished
        d["eval"] = eval_view(self.run_state)
        d["best"] = best_view(self.run_state)
        return d


def eval_view(run_state: RunState) -> dict[str, Any] | None:
    """status --json `eval`: the last held-out evaluation as run-state.json records it (the Eval
    line's fields: step, tau, tau_real, loss, acc, acc_at, tau_exp, best) and `share`, the
    fraction of wall time evaluations cost so far; None before the run's first evaluation."""
    ev = run_state.last_eval
    if ev is None:
        return None
    return {**ev.model_dump(mode="json", exclude={"kind", "extra"}), "share": run_state.eval_share}


class BestView(TypedDict):
    """status --json `best`."""

    step: int
    tau: float | None
    checkpoint: str | None


def best_view(run_state: RunState) -> BestView | None:
    """status --json `best`: {step, tau, checkpoint} of the best checkpoint (highest held-out tau,
    ties to the later step; `checkpoint` as the trainer resolved it); None while there is none."""
    if run_state.best_step is None:
        return None
    return BestView(
        step=run_state.best_step, tau=run_state.best_tau, checkpoint=run_state.best_checkpoint
    )


def _tau(value: float | None) -> str:
    return "---" if value is None else f"{value:.3f}"


def run_dir_path(path: str) -> str:
    """A checkpoint path from run-state.json as people read it: from `checkpoints/` on (the run
    directory is the host's `run/`), or as written when it is elsewhere."""
    cut = path.rfind("/checkpoints/")
    return path[cut + 1 :] if cut >= 0 else path


def eval_summary(run_state: RunState) -> str | None:
    """`eval: step 400 tau=3.214 (best 400, tau=3.214, checkpoints/step-00000400.pt); evals cost
    2.1% of wall time` for `dflashctl status` and the demo; None for a run that never evaluated."""
    ev, best = run_state.last_eval, best_view(run_state)
    if ev is None and best is None:
        return None
    head = f"eval: step {ev.step} tau={_tau(ev.tau)}" if ev else "eval: none recorded yet"
    if best is None:
        tail = " (no best checkpoint yet)"
    else:
        where = run_dir_path(best["checkpoint"]) if best["checkpoint"] else "checkpoint unknown"
        tail = f" (best {best['step']}, tau={_tau(best['tau'])}, {where})"
    share = run_state.eval_share
    cost = f"; evals cost {100 * share:.1f}% of wall time" if share is not None else ""
    return head + tail + cost


def run_finished(state: str, exit_status: int | None, run_state: RunState) -> bool:
    """A clean exit whose run-state.json says the whole plan was trained (state "finished")."""
    return state == "stopped" and exit_status == 0 and run_state.state == "finished"


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

    def summary(self) -> str:
        """What stop found and did, for people (the CLI and the demo print it)."""
        if not self.was_running:
            if self.exit_status is None:
                return "not running"
            return f"not running: the run had already exited with status {self.exit_status}"
        ck = self.checkpoint
        saved = f"checkpoint step {ck.step} at {ck.path}" if ck else "NO checkpoint line seen"
        return f"stopped ({self.outcome}); {saved}"


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
    when that link drops); the reconnecting loop around it lives in `dflashctl.follow`.
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


def split_sections(stdout: str) -> dict[str, str]:
    """MARK-delimited sections -> {name: text}."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in stdout.split("\n"):
        if line.startswith(MARK):
            current = sections.setdefault(line[len(MARK) :].strip(), [])
        elif current is not None:
            current.append(line)
    return {k: "\n".join(v).strip("\n") for k, v in sections.items()}


def _events(text: str) -> list[Event]:
    return [parse_line(line) for line in text.splitlines() if line.strip()]


def current_run_start(events: list[Event]) -> int:
    """Index of the first event of the last run in a status.log (the trainer appends across runs).

    A run begins with its "loading" phase line, or with "starting" when no "loading" line of a
    run still in its setup opened it (trainers that skip that phase; an ERROR ends a setup);
    errors before that index belong to earlier runs.
    """
    begin, in_setup = 0, False
    for i, e in enumerate(events):
        if isinstance(e, ErrorEvent):
            in_setup = False
        elif isinstance(e, PhaseEvent):
            if e.phase == "loading":
                begin, in_setup = i, True
            elif e.phase == "starting":
                if not in_setup:
                    begin = i
                in_setup = False
    return begin


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _pane_signal(pane_text: str) -> int | None:
    """The #{pane_dead_signal} field of a PANE_FORMAT line, when the pane died by a signal."""
    line = pane_text.strip().splitlines()[-1] if pane_text.strip() else ""
    parts = line.split("|")
    return int(parts[2]) if len(parts) == 4 and parts[2].isdigit() else None


@dataclass(frozen=True)
class SupervisorFile:
    """RUN/supervisor.json as `trainer.supervise` writes it (not run-state: the supervisor is
    its only writer). `fields` is the file's object (strings safe to print): status --json
    passes SUPERVISOR_KEYS of it through; the properties are what run control decides on."""

    fields: dict[str, Any]

    @property
    def pid(self) -> int | None:
        return _int_or_none(self.fields.get("pid"))

    @property
    def state(self) -> str | None:
        value = self.fields.get("state")
        return value if isinstance(value, str) else None

    @property
    def trainer_pid(self) -> int | None:
        return _int_or_none(self.fields.get("trainer_pid"))

    @property
    def gave_up(self) -> bool:
        return self.fields.get("gave_up") is True or self.state == "gave-up"

    @property
    def restarts(self) -> list[dict[str, Any]]:
        raw = self.fields.get("restarts")
        return [r for r in raw if isinstance(r, dict)] if isinstance(raw, list) else []

    @property
    def policy(self) -> dict[str, Any]:
        raw = self.fields.get("policy")
        return raw if isinstance(raw, dict) else {}


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def parse_supervisor_file(
    text: str, name: str = SUPERVISOR_STATE_FILE
) -> tuple[SupervisorFile | None, str | None]:
    """supervisor.json -> (its fields, None); none -> (None, None); corrupted -> (None, why)."""
    raw, error = read_json_object(text, name)
    return (SupervisorFile(raw) if raw is not None else None), error


def pane_supervisor(
    supervisor: SupervisorFile | None, pane: PaneState | None
) -> SupervisorFile | None:
    """supervisor.json when it is the pane's process's (same pid), else None.

    The file outlives its run (a stopped session, an older start): only the supervisor that is
    the pane's process speaks for the run the pane shows.
    """
    if supervisor is None or pane is None or pane.pid is None or supervisor.pid != pane.pid:
        return None
    return supervisor


def supervisor_view(
    sup: SupervisorFile | None,
) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """(`supervisor` for status, its `restarts` list): the keys status --json documents."""
    if sup is None or not sup.fields:
        return None, []
    restarts = sup.restarts
    view = {k: sup.fields.get(k) for k in SUPERVISOR_KEYS}
    view["gave_up"] = sup.gave_up
    view["restarts"] = restarts
    return view, restarts


def restart_time(record: dict[str, Any]) -> float | None:
    """Epoch seconds of a restart record's `at` (ISO-8601 UTC, as the supervisor writes it)."""
    return iso_time(record.get("at"))


def iso_time(value: object) -> float | None:
    """Epoch seconds of an ISO-8601 UTC time as the supervisor writes them (`at`, `since`)."""
    if not isinstance(value, str):
        return None
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()


def restart_reason(record: dict[str, Any]) -> str:
    """`signal 9, resumed from step 200` (or the newest checkpoint while it has not said)."""
    text = str(record.get("reason") or "?")
    resumed, ckpt = record.get("resumed_step"), record.get("checkpoint_step")
    if isinstance(resumed, int):
        return f"{text}, resumed from step {resumed}"
    if isinstance(ckpt, int):
        return f"{text}, from checkpoint step {ckpt}"
    return text


def trainer_completed_stop(
    run_state: RunState, pane: PaneState, supervisor: SupervisorFile | None = None
) -> bool:
    """The pane's process recorded a stop (or the end of its plan) before it ended.

    Whatever signal the pane reports last (a second Ctrl-C during the checkpoint), the trainer's
    own record is the truth when it is this process's (same pid; under the supervisor, the pid
    of the supervisor's current trainer); its `stop_detail` says what the stop kept.
    """
    owners = {pane.pid} if pane.pid is not None else set()
    if supervisor is not None and supervisor.trainer_pid is not None:
        owners.add(supervisor.trainer_pid)
    return run_state.pid in owners and run_state.state in {"stopped", "finished"}


def parse_running_measure(sections: dict[str, str], session: str) -> RunningMeasure | None:
    """The status script's measure sections (already sanitised) -> the measure running now:
    the newest measure, without an exit status, whose session's pane is alive; else None (one
    that ended, or was lost with its session, is `dflashctl measure HOST --result`'s)."""
    mid = sections.get("measure", "").strip()
    started = measure_started(mid) if re.match(MEASURE_ID_PATTERN, mid) else None
    pane = parse_pane_state(sections.get("measure_pane", ""))
    if started is None or pane is None or pane.dead:
        return None
    now = sections.get("now", "").strip()
    lines = [ln.strip() for ln in sections.get("measure_progress", "").splitlines() if ln.strip()]
    return RunningMeasure(
        id=mid,
        session=measure_session(session),
        since=iso_utc(started),
        age_s=max(0.0, int(now) - started) if now.isdigit() else None,
        progress=lines[-1] if lines else None,
    )


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


def parse_status(
    host: str,
    stdout: str,
    hash_text: Callable[[str], str | None],
    *,
    session: str = "dflash",  # the inventory's default
) -> RunStatus:
    """Build a RunStatus from the status script's output (pure apart from `hash_text`);
    `session` is the host's tmux session (a running measure's is named after it).

    The one reader of status output: every section shown to people passes through
    `sanitize_for_terminal` here (the config is only hashed, so it stays byte-exact).
    """
    raw = split_sections(stdout)
    if "noworkdir" in raw:
        return RunStatus(host=host, state="stopped", message="nothing deployed yet")
    s = {k: v if k == "config" else sanitize_for_terminal(v) for k, v in raw.items()}
    pane = parse_pane_state(s.get("pane", "")) if s.get("session") == "yes" else None
    capture = s.get("capture", "")
    run_state, run_state_error = parse_run_state(s.get("run_state", ""), RUN_STATE_FILE)
    sup_file, sup_error = parse_supervisor_file(s.get("supervisor", ""))
    sup = pane_supervisor(sup_file, pane)
    sup_state = sup.state if sup else None
    sig: int | None = None
    if pane is None:
        state, exit_status = "stopped", None
    elif not pane.dead:
        # The pane's process is the supervisor: alive while the trainer under it is restarted.
        state = sup_state if sup_state in {"restarting", "stalled"} else "running"
        exit_status = None
    else:
        exit_status = pane.exit_status
        state = "stopped" if exit_status == 0 else "crashed"
        if state == "crashed" and trainer_completed_stop(run_state, pane, sup):
            state = "stopped"
            if run_state.exit_status is not None:
                exit_status = run_state.exit_status
        elif sup is not None and sup.gave_up:
            state = "gave-up"
        elif state == "crashed" and sup_state == "stopped":
            state = "stopped"  # the operator stopped it during a restart backoff
        else:
            sig = _pane_signal(s.get("pane", ""))
            if sig is None and sup and isinstance(exit_status, int) and exit_status > 128:
                sig = exit_status - 128  # the supervisor exits 128 + N for a trainer killed by N
    supervisor, restarts = supervisor_view(sup)
    log_events = _events(s.get("log", ""))
    last_status = next((e for e in reversed(log_events) if isinstance(e, StatusEvent)), None)
    last_ckpt = next((e for e in reversed(log_events) if isinstance(e, CheckpointEvent)), None)
    # The capture is taken with -J: tmux already re-joined wrapped rows, so re-joining rows that
    # happen to be exactly the pane width would glue separate lines together.
    pane_events = _events(capture)
    if last_status is None:
        last_status = next((e for e in reversed(pane_events) if isinstance(e, StatusEvent)), None)
    if last_ckpt is None:
        last_ckpt = next((e for e in reversed(pane_events) if isinstance(e, CheckpointEvent)), None)
    # Errors of the current run only: status.log keeps every run's lines, the pane only this one.
    this_run = log_events[current_run_start(log_events) :]
    errors = [e for e in [*this_run, *pane_events] if isinstance(e, ErrorEvent)]
    config_text = s.get("config", "")
    lines = s.get("log_lines", "0").strip()
    current = s.get("current", "").strip()
    stop_signal = run_state.stop_signal
    return RunStatus(
        host=host,
        state=state,
        exit_status=exit_status,
        release=current.rsplit("/", 1)[-1] if current else None,
        run_release=s.get("run_release", "").strip() or run_state.release,
        config_hash=run_state.config_hash,
        deployed_config_hash=hash_text(config_text) if config_text else None,
        last_event=last_status,
        last_checkpoint=last_ckpt,
        last_error=errors[-1].message if errors else None,
        log_lines=int(lines) if lines.isdigit() else 0,
        run_state=run_state,
        pane_tail=capture.splitlines()[-20:] if state == "crashed" else [],
        signal=signal_name(sig) if sig is not None else None,
        stop_signal=stop_signal or None,
        run_state_error=run_state_error,
        switch_note=switch_note(s.get("switched", ""), current),
        supervisor=supervisor,
        restarts=restarts,
        supervisor_error=sup_error,
        release_has_supervisor=s.get("supervisable", "").strip() == "yes",
        measure=parse_running_measure(s, session),
    )


TORCHRUN_SHUTDOWN_TIMEOUT_S = 600
"""How long torchrun waits for its ranks after forwarding a stop before it SIGKILLs them."""


def _rank_count(config_text: str) -> int:
    """The ranks the deployed config needs on this host; 1 when it does not validate here (the
    trainer names the problem itself, as it did before torchrun starts existed)."""
    from dflashctl.runconfig import RunConfigError, drafter_device_count

    try:
        return drafter_device_count(config_text) if config_text else 1
    except RunConfigError:
        return 1


def interrupt_children(pid: int) -> list[str]:
    """SIGINT to every child of `pid` (a group node's torchrun: its trainer ranks)."""
    return ["pkill", "-INT", "-P", str(int(pid))]


def kill_if_childless(pid: int) -> list[str]:
    """SIGKILL `pid` unless it still has children (a torchrun whose ranks all exited)."""
    # without pgrep nothing is known of its children: then nothing is killed
    script = 'command -v pgrep >/dev/null && ! pgrep -P "$1" >/dev/null && kill -KILL "$1"'
    return ["sh", "-c", script, "kill-if-childless", str(int(pid))]


def last_error_line(log_text: str, capture: str) -> str | None:
    """The run's own ERROR line (status.log, else the pane), else the pane's last line."""
    for text in (log_text, capture):
        errors = [e for e in _events(text) if isinstance(e, ErrorEvent)]
        if errors:
            return errors[-1].message
    # tmux's own remain-on-exit line ("Pane is dead (status 1, ...)") says nothing new
    rows = [
        ln.strip()
        for ln in capture.splitlines()
        if ln.strip() and not ln.strip().startswith("Pane is dead")
    ]
    return rows[-1] if rows else None


def describe_exit(exit_status: int | None, sig: int | None) -> str:
    if sig is not None:
        return f"was killed by {signal_name(sig)} (exit status {128 + sig})"
    if exit_status is None:
        return "exited (no exit status)"
    what = {1: " (failed)", 2: " (refused: a user error)"}.get(exit_status, "")
    return f"exited with status {exit_status}{what}"


def parse_gpu_csv(stdout: str) -> list[GpuSample]:
    def num(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:
            return None  # "[N/A]", "[Not Supported]"

    out: list[GpuSample] = []
    for line in stdout.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 7 or not cols[0].isdigit():
            continue
        out.append(
            GpuSample(
                int(cols[0]),
                cols[1],
                num(cols[2]),
                num(cols[3]),
                num(cols[4]),
                num(cols[5]),
                num(cols[6]),
            )
        )
    return out


# --- the service ---------------------------------------------------------------------------


class RunControl:
    """Operate one host's run through a Transport (SSH+pct or local)."""

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        self.transport = transport
        self.host = host
        self.layout = RemoteLayout(host.workdir)
        self._health_prefix = REASONS_PREFIX  # nvidia-smi's clock-event field names (535+)

    async def _run(
        self, argv: list[str], *, timeout: float | None = None, input: bytes | None = None
    ) -> CommandResult:
        # timeout None: the transport's own default, the host's command_timeout.
        return await self.transport.run(argv, timeout=timeout, input=input)

    async def _pane_state(self) -> PaneState | None:
        """The pane's state once tmux has its exit status (one round trip); None: no session."""
        res = await self._run(tmux_settled_pane_state(self.host.session))
        return parse_pane_state(res.stdout) if res.ok else None

    async def status(self, *, setup_errors: bool = False) -> RunStatus:
        """Never raises for transport problems: an unreachable host is a state.

        A local SSH setup problem (missing identity file, unreadable known_hosts: an
        InventoryError) is that host's state too, except with `setup_errors`, which the
        single-host commands pass so it reaches the user as the config error it is (exit 2).
        """
        from dflashctl.runconfig import config_hash_of_text

        try:
            res = await self._run(status_argv(self.host.workdir, self.host.session))
        except TransportError as err:
            if setup_errors and isinstance(err, InventoryError):
                raise
            return RunStatus(host=self.host.name, state="unreachable", message=str(err))
        if not res.ok:
            msg = res.error_line()
            if "not running" in msg:
                msg = f"container {self.host.ctid} is not running (pct start {self.host.ctid})"
            return RunStatus(
                host=self.host.name,
                state="unreachable",
                message=sanitize_for_terminal(f"{self.host.name}: {msg}"),
            )
        return parse_status(
            self.host.name, res.stdout, config_hash_of_text, session=self.host.session
        )

    async def deployed_config(self) -> str:
        res = await self._run(read_file(self.layout.config))
        return res.stdout if res.ok else ""

    async def push_config(self, path: Path) -> None:
        await push_config_file(self.transport, self.host, path)

    async def put_secret(self, name: str, data: bytes) -> str:
        """Write a secret to WORKDIR/secrets/NAME (0600) through stdin: never on a command line."""
        if not NAME_RE.match(name):
            raise ControlError(f"{self.host.name}: secret name {name!r} is not a plain name")
        path = self.layout.secret(name)
        res = await self._run(write_file_atomic(path, "600"), input=data)
        if not res.ok:
            raise ControlError(f"{self.host.name}: writing {path}: {res.error_line()}")
        return path

    async def start(
        self,
        *,
        fresh: bool = False,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Callable[[str], None] | None = None,
    ) -> StartResult:
        """Start the trainer and wait (up to `wait_s`) until it is past its setup or has exited.

        The trainer runs under the in-container supervisor (`python -m trainer.supervise`) with
        the host's restart policy, when the release ships it (an older release runs bare, with
        a note). A trainer that exits in that time (bad device, a store that is not a store, a
        refused resume) raises StartFailed with its exit status and last error line, also when
        the supervisor is about to restart it: "started" must never be said of a run that is
        already dead. `wait_s=0` skips the wait.
        """
        return await self._start(fresh, resume, wait_s, progress, None)

    async def start_node(
        self,
        launch: NodeLaunch,
        *,
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Callable[[str], None] | None = None,
    ) -> StartResult:
        """Start this host's part of a group (`dflashctl.launch`): the pane runs the launch's
        torchrun argv with its env added, and no supervisor: a node restarted alone cannot
        rejoin the group's static rendezvous, so a group's restarts are the whole group's
        (`dflashctl restart GROUP`). Otherwise as `start`."""
        fresh = "--fresh" in launch.program
        return await self._start(fresh, "auto", wait_s, progress, launch)

    async def _start(
        self,
        fresh: bool,
        resume: str,
        wait_s: float,
        progress: Callable[[str], None] | None,
        launch: NodeLaunch | None,
    ) -> StartResult:
        st = await self.status(setup_errors=True)
        if st.state == "unreachable":
            raise HostUnreachable(st.message or f"{self.host.name}: unreachable")
        argv = launch.argv if launch is not None else trainer_argv(self.host.python, fresh, resume)
        if st.state in LIVE_STATES:
            return StartResult(self.host.name, False, st.run_release or "", None, argv)
        if st.measure is not None:  # read in the same round trip as the run's status
            raise measure_refusal(st.measure, self.host.name)
        if st.release is None:
            raise ControlError(
                f"{self.host.name}: nothing deployed; run `dflashctl deploy {self.host.name}`"
            )
        config_text = await self.deployed_config()  # read once: it also gives the rank count
        if st.deployed_config_hash is None and not config_text:
            raise ControlError(
                f"{self.host.name}: no {self.layout.config}; "
                f"deploy with --config PATH or set run_config in hosts.toml"
            )
        if launch is None:  # several drafter (or shared target) ranks: torchrun --standalone
            argv = host_trainer_argv(self.host.python, fresh, resume, _rank_count(config_text))
        if st.exit_status is not None:  # a dead pane from the last run: clear it
            await self._run(tmux_kill_session(self.host.session))
        release = st.release
        rec = await self._run(
            write_file_atomic(self.layout.running_release, "644"),
            input=f"{release}\n".encode(),
        )
        if not rec.ok:
            raise ControlError(f"{self.host.name}: recording the run's release: {rec.error_line()}")
        env = {
            **self.host.env,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": self.layout.release_dir(release),
            "DFLASH_RELEASE": release,
            **(launch.env if launch is not None else {}),
        }
        if launch is None and argv[1:3] == ["-m", TORCHRUN_MODULE]:
            # torchrun SIGKILLs its ranks 30 s after forwarding a stop's SIGINT by default: a
            # checkpoint of a real-width drafter can take longer (the operator's env wins). Not
            # for group nodes: there a dead peer must end the others' ranks promptly.
            env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(TORCHRUN_SHUTDOWN_TIMEOUT_S))
        notes = [st.switch_note] if st.switch_note else []
        if st.release_has_supervisor and launch is None:
            argv = supervised(self.host.python, self.host.supervisor_policy().cli_args(), argv)
        if st.switch_note:
            await self._run(acknowledge_switch(self.host.workdir))
        res = await self.new_session(argv, env)
        if not res.ok:
            raise ControlError(f"{self.host.name}: tmux new-session: {res.error_line()}")
        state = await self._pane_state()
        pid = state.pid if state else None
        if wait_s <= 0:
            return StartResult(self.host.name, True, release, pid, argv, notes=notes)
        if progress:
            progress(f"{self.host.name}: waiting up to {wait_s:g} s for the trainer's setup")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outcome = await self.wait_started(st.log_lines, wait_s)
        took = loop.time() - t0
        if outcome in {"exited", "restarting"}:
            raise await self.start_failure(st.log_lines, took, restarting=outcome == "restarting")
        return StartResult(
            self.host.name, True, release, pid, argv, outcome == "ready", took, notes
        )

    async def wait_started(self, mark: int, wait_s: float) -> str:
        """Wait (one remote loop) until the trainer started at status.log line `mark` is past
        its setup, is being restarted or has exited: `ready` | `restarting` | `exited` |
        `waiting` (still setting up after `wait_s`)."""
        waited = await self._run(
            start_wait_argv(self.host.workdir, self.host.session, mark, wait_s),
            timeout=wait_s + 60,
        )
        return (waited.stdout.strip().splitlines() or ["waiting"])[-1]

    async def start_failure(self, mark: int, took: float, restarting: bool = False) -> StartFailed:
        """What a trainer that exited during its start said: exit status and last error.

        Under the supervisor the pane's status is the supervisor's, which passes the trainer's
        on (a signal death as 128 + N); a trainer it is restarting is described from its
        restart record, and the message says what the supervisor does next.
        """
        pane = await self._run(tmux_settled_pane_state(self.host.session))
        state = parse_pane_state(pane.stdout) if pane.ok else None
        sig = _pane_signal(pane.stdout) if pane.ok else None
        try:
            log = "\n".join(await self.log_tail(mark))
        except ControlError:
            log = ""  # the pane still tells
        cap = await self._run(tmux_capture(self.host.session, 300))
        error = last_error_line(log, sanitize_for_terminal(cap.stdout if cap.ok else ""))
        sup_res = await self._run(read_file(self.layout.supervisor_state))
        sup_file, _ = parse_supervisor_file(sup_res.stdout if sup_res.ok else "")
        sup = pane_supervisor(sup_file, state)
        exit_status = state.exit_status if state else None
        after = ""
        if sup and restarting:
            restarts = sup.restarts
            last = restarts[-1] if restarts else {}
            code = last.get("exit_status")
            exit_status, sig = (code, None) if isinstance(code, int) and code >= 0 else (None, None)
            if isinstance(code, int) and code < 0:
                sig = -code
            policy = sup.policy
            wait = last.get("backoff_s")
            after = (
                f"; its supervisor restarts it (restart {len(restarts)} of "
                f"{policy.get('max_restarts', '?')}, in "
                f"{f'{wait:g}' if isinstance(wait, int | float) else '?'} s): "
                f"`dflashctl stop {self.host.name}` ends it"
            )
        elif sup and sig is None and isinstance(exit_status, int) and exit_status > 128:
            sig = exit_status - 128  # the supervisor exits 128 + N for a trainer killed by N
        how = describe_exit(exit_status, sig)
        return StartFailed(
            f"{self.host.name}: the trainer {how} {took:.0f} s after it was started: "
            f"{error or 'it printed nothing'}{after}"
        )

    async def new_session(self, argv: list[str], env: dict[str, str]) -> CommandResult:
        """`tmux new-session` for the host's session running argv in the workdir.

        Killing a server's last session makes it exit, and a client that reaches it meanwhile
        fails with "server exited unexpectedly" (stop, or start clearing a dead pane, right
        before a new session): that is retried, so a restart never fails on the timing.
        """
        command = tmux_new_session(self.host.session, argv, cwd=self.host.workdir, env=env)
        for attempt in range(5):
            res = await self._run(command)
            if res.ok or "server exited unexpectedly" not in res.stderr:
                break
            await asyncio.sleep(0.1 * (attempt + 1))
        return res

    async def stop(self, timeout: float = 120.0) -> StopResult:
        """SIGINT, wait for the checkpoint line (or exit) up to `timeout`, then kill the session.

        The C-c reaches the pane's process: the supervisor forwards it to the trainer once (a
        graceful stop, never restarted) or, in a restart backoff, exits without another attempt.
        """
        return await self._stop(timeout)

    async def stop_node(
        self,
        timeout: float = 120.0,
        *,
        settle_s: float = 0.0,
        interrupt: bool = True,
        after_interrupt: Callable[[], Awaitable[None]] | None = None,
    ) -> StopResult:
        """Stop this host's part of a group, as `stop` does, except:

        SIGINT goes to the pane process's children, the trainer ranks, not to torchrun:
        torchrun would pass a second SIGINT on (a stop at once, no checkpoint) and exit as a
        signal death; the ranks' stop is agreed in the step's reduce, so they stop at the same
        step and torchrun exits 0.
        `settle_s`: after the checkpoint line, wait up to this long more for the pane's
        process to exit by itself (torchrun meets its peers at an exit barrier: ending its
        session before would fail the other nodes' agents and leave this one holding its
        rendezvous port while it shuts down). `interrupt=False`: the ranks were signalled
        already (a group's other nodes): only wait and clear. `after_interrupt` runs right
        after this node's SIGINT, before the wait (a group signals its other nodes there).
        """
        return await self._stop(
            timeout,
            workers=True,
            settle_s=settle_s,
            interrupt=interrupt,
            after_interrupt=after_interrupt,
        )

    async def _stop(
        self,
        timeout: float,
        *,
        workers: bool = False,
        settle_s: float = 0.0,
        interrupt: bool = True,
        after_interrupt: Callable[[], Awaitable[None]] | None = None,
    ) -> StopResult:
        st = await self.status(setup_errors=True)
        if st.state == "unreachable":
            raise HostUnreachable(st.message or f"{self.host.name}: unreachable")
        if st.state not in LIVE_STATES:
            if st.exit_status is not None:
                await self._run(tmux_kill_session(self.host.session))
            return StopResult(
                self.host.name,
                False,
                None,
                "dead" if st.exit_status is not None else "not-running",
                st.exit_status,
            )
        mark = st.log_lines
        if workers and interrupt:
            await self.interrupt_workers()
        elif not workers:
            sent = await self._run(tmux_interrupt(self.host.session))
            if not sent.ok:
                raise ControlError(f"{self.host.name}: sending C-c: {sent.error_line()}")
        if after_interrupt is not None:
            await after_interrupt()
        waited = await self._run(
            stop_wait_argv(self.host.workdir, self.host.session, mark, timeout),
            timeout=timeout + 30,
        )
        outcome = (waited.stdout.strip().splitlines() or ["timeout"])[-1]
        if outcome == "checkpointed" and settle_s > 0:
            # the same wait past the log's end: it ends only when the pane's process exits
            settled = await self._run(
                stop_wait_argv(self.host.workdir, self.host.session, 10**9, settle_s),
                timeout=settle_s + 30,
            )
            if (settled.stdout.strip().splitlines() or [""])[-1] == "exited":
                outcome = "exited"
        log = await self._run(tail_from(self.layout.status_log, mark))
        cap = await self._run(tmux_capture(self.host.session, 300))
        # Only checkpoints written after the interrupt count: status.log lines past the mark, or
        # (trainers that only print) pane lines newer than the last checkpoint known before it.
        before = st.last_checkpoint.step if st.last_checkpoint else -1
        ckpts = [e for e in _events(log.stdout if log.ok else "") if isinstance(e, CheckpointEvent)]
        if not ckpts:
            pane_events = _events(cap.stdout if cap.ok else "")  # -J: rows already joined
            ckpts = [e for e in pane_events if isinstance(e, CheckpointEvent) and e.step > before]
        state = await self._pane_state()
        if workers and state is not None and not state.dead and state.pid is not None:
            # torchrun outlived its ranks (stuck at its exit barrier: a peer's agent failed);
            # ending the session alone would not end it (it handles SIGHUP only between
            # waits) and it would hold the rendezvous port: killed, once it has no ranks left
            await self._run(kill_if_childless(state.pid))
        await self._run(tmux_kill_session(self.host.session))
        best = max(ckpts, key=lambda e: e.step) if ckpts else None
        return StopResult(
            self.host.name, True, best, outcome, state.exit_status if state and state.dead else None
        )

    async def interrupt_workers(self) -> None:
        """SIGINT to the pane process's children (a group node's torchrun: its ranks)."""
        pane = await self._pane_state()
        if pane is None or pane.pid is None or pane.dead:
            return
        sent = await self._run(interrupt_children(pane.pid))
        # pkill's 1: no child (the ranks exited meanwhile): the stop's wait sees the exit
        if sent.rc not in {0, 1}:
            raise ControlError(f"{self.host.name}: SIGINT to the ranks: {sent.error_line()}")

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
    ) -> RestartResult:
        """Push config, deploy if the tree changed, stop, start.

        Refused (MeasureInProgress) before anything is pushed while a measure runs there.

        Refuses (ResumeRefused) when the config cannot resume the checkpoint a resume would load
        and `fresh` is not set: silently training from scratch, or crashing on resume, both waste
        GPU hours. The check is the one `deploy --config` makes (dflashctl.resume).
        """
        from dflashctl.resume import check_config_push
        from dflashctl.runconfig import (
            config_diff,
            config_hash_of_file,
            config_hash_of_text,
            read_config_text,
            validate_config,
        )

        path = config or self.host.run_config
        if path is not None:  # a bad local config fails before anything touches the host
            new_text = read_config_text(path)
            validate_config(path)
        before = await self.status(setup_errors=True)
        if before.measure is not None:  # refused before the deploy and the stop, not after
            raise measure_refusal(before.measure, self.host.name, "a restarted run")
        old_text = await self.deployed_config()
        diff = ""
        new_hash = config_hash_of_text(old_text) if old_text else None
        if path is not None:
            diff = config_diff(
                old_text, new_text, old_name=f"{self.host.name}:{CONFIG}", new_name=str(path)
            )
            check = await check_config_push(
                self.transport, self.host, path, fresh=fresh, resume=resume
            )
            for note in check.notes:
                if progress:
                    progress(note)
            new_hash = config_hash_of_file(path)
        dep = await deploy(
            self.transport,
            self.host,
            config=path,
            progress=progress,
            release=release,
            resume_checked=True,
            memory_check=True,  # refuse a config that cannot fit before the run is stopped
        )
        stopped = await self.stop(stop_timeout)
        started = await self.start(fresh=fresh, resume=resume, wait_s=wait_s, progress=progress)
        return RestartResult(
            self.host.name,
            dep,
            stopped,
            started,
            diff,
            config_hash_of_text(old_text) if old_text else None,
            new_hash,
        )

    async def checkpoint_config(self, resume: str = "auto") -> CheckpointConfig | None:
        """The config saved in the checkpoint a resume would load (None: cannot tell)."""
        from dflashctl.resume import read_checkpoint_config

        return await read_checkpoint_config(self.transport, self.host, resume)

    async def gpus(self) -> list[GpuSample]:
        """GPU samples from nvidia-smi in the container ([] when it has none)."""
        res = await self._run(gpu_query_argv())
        if res.rc == 127 or "not found" in res.stderr or "No such file" in res.stderr:
            return []
        if not res.ok:
            raise ControlError(f"{self.host.name}: nvidia-smi: {res.error_line()}")
        return parse_gpu_csv(res.stdout)

    async def gpu_health(self) -> list[GpuHealth]:
        """ECC counts and clock-event (throttle) reasons per GPU ([] without nvidia-smi). A
        pre-535 driver refuses the new field names: asked again with its own, remembered."""
        for _ in range(2):
            prefix = self._health_prefix
            res = await self._run(health_query_argv(prefix))
            if res.rc == 127 or "not found" in res.stderr or "No such file" in res.stderr:
                return []
            if unknown_query_field(res.stderr) and prefix == REASONS_PREFIX:
                self._health_prefix = LEGACY_REASONS_PREFIX
                continue
            if not res.ok:
                raise ControlError(f"{self.host.name}: nvidia-smi: {res.error_line()}")
            healths, errors = parse_health_csv(res.stdout, health_fields(prefix))
            if errors and not healths:
                raise ControlError(f"{self.host.name}: {errors[0]}")
            return healths
        return []

    async def log_tail(self, from_line: int) -> list[str]:
        """run/status.log from 0-based `from_line`, made safe to print."""
        res = await self._run(tail_from(self.layout.status_log, from_line))
        if not res.ok and "No such file" not in res.stderr:
            raise ControlError(f"{self.host.name}: reading {STATUS_LOG}: {res.error_line()}")
        return sanitize_for_terminal(res.stdout).splitlines()

    async def log_line_count(self) -> int | None:
        """Lines in run/status.log now: 0 when it is gone, None when it cannot be told (a
        command timeout, an unreadable answer). A follower compares it with the lines it has
        read to see that the log started over."""
        try:
            res = await self._run(line_count(self.layout.status_log))
        except CommandTimeout:
            return None  # unknown: keep the count (the tail itself will show what is wrong)
        if not res.ok:
            return 0 if "No such file" in res.stderr else None
        count = res.stdout.split()[:1]  # "N path"
        return int(count[0]) if count and count[0].isdigit() else None

    async def tail_log(self, from_line: int) -> AsyncGenerator[str, None]:
        """One connection's `tail -F` of run/status.log from 0-based `from_line`, made safe to
        print (the one reader of the live log).

        Only newline-terminated lines are delivered, so the count of lines received is the
        resume point. It ends when the stream ends and raises TransportError (HostUnreachable,
        HostKeyError) when the link drops; reconnecting is the caller's (dflashctl.follow).
        """
        path = self.layout.status_log
        async for line in self.transport.stream_lines(guarded(tail_follow(path, from_line))):
            yield sanitize_for_terminal(line)

    def follow(
        self,
        from_line: int = 0,
        *,
        delay: Callable[[int], float] | None = None,
        max_attempts: int | None = None,
    ) -> AsyncGenerator[FollowEvent, None]:
        """status.log from 0-based `from_line`, forever, across dropped links, as the one follow
        loop's typed events (`dflashctl.follow`): no line repeated or skipped on a reconnect,
        a log that started over read again from its first line. `delay` defaults to a
        jittered backoff."""
        follower = LogFollower(
            self,
            from_line,
            delay=delay or Backoff(jitter=FOLLOW_JITTER).delay,
            max_attempts=max_attempts,
            name=self.host.name,
        )
        return follower.events()


if TYPE_CHECKING:
    _: type[RunService] = RunControl  # RunControl satisfies the protocol (checked by mypy)
