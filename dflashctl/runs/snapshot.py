"""What one host's run looks like: the `RunStatus` snapshot and the pure parsers that build it.

`parse_status` is the one reader of the status script's output (`dflashctl.remote.run`): tmux's
pane state, status.log's events, run-state.json, the supervisor's file, a running measure; every
section shown to people passes through `sanitize_for_terminal` there. Nothing here runs a
command: `dflashctl.runs.control.RunControl` fetches the text and calls these.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from typing import Any, TypedDict

from dflashctl.releases.deploy import switch_note
from dflashctl.remote.layout import MEASURE_ID_FORMAT, MEASURE_ID_PATTERN, measure_session
from dflashctl.remote.layout import RUN_STATE as RUN_STATE_FILE
from dflashctl.remote.layout import SUPERVISOR_STATE as SUPERVISOR_STATE_FILE
from dflashctl.remote.run import MARK
from dflashctl.remote.tmux import PaneState, parse_pane_state
from dflashctl.runs.regen_view import RegenJob, parse_regen_job
from dflashctl.runs.stale import (
    checkpoint_failure,
    newest_status,
    stale_note,
    stale_state,
    stale_supervisor,
)
from trainer.events import (
    CheckpointEvent,
    CheckpointFailed,
    ErrorEvent,
    Event,
    PhaseEvent,
    StatusEvent,
    parse_line,
    sanitize_for_terminal,
)
from trainer.events.run_state import RunState, parse_run_state, read_json_object
from trainer.events.served import ServedSummary, parse_served_summary

SUPERVISOR_KEYS = (
    "state",
    "gave_up",
    "attempt",
    "trainer_pid",
    "detail",
    "exit_status",
    "policy",
    # the first low filesystem, and every one: {free_mib, needed_mib, path, holds, text,
    # consequence, since; checkpoint_mib, checkpoints where the checkpoints are}
    "low_disk",
    "low_disks",
    # a group node's: its place, its agent, the failures it saw and its group's attempt
    "group",
    "agent_pid",
    "group_rank",
    "failures",
)


PANE_LINES = 8
"""How many of the pane's last lines a status keeps whatever the run's state (a group's status
shows every node's)."""


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
class RunningJob:
    """A `dflashctl eval` or `gate` running on a host, as status reads it (none: None)."""

    kind: str  # "eval" | "gate"
    id: str
    session: str  # its tmux session (the host's session + `-eval` / `-gate`)
    since: str
    age_s: float | None = None
    progress: str | None = None  # its last output line (made safe to print)


@dataclass(frozen=True)
class ServedEval:
    """The newest `dflashctl eval` on a host that left a summary (status `served`): the
    engine's acceptance beside the project's loop on what it evaluated."""

    id: str  # the eval job's id (its UTC start)
    since: str  # `2026-12-01 17:02:11 UTC`
    summary: ServedSummary
    checkpoint: str | None = None  # the checkpoint it exported, as resolved in the container
    step: int | None = None  # that checkpoint's step
    age_s: float | None = None  # seconds since it started, by the host's clock

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "since": self.since,
            "checkpoint": self.checkpoint,
            "step": self.step,
            "age_s": self.age_s,
            "summary": self.summary.model_dump(mode="json"),
        }


@dataclass(frozen=True)
class RunStatus:
    host: str
    # running | restarting | stalled | rendezvous (a group node waiting for the others) |
    # stopped | crashed | gave-up | unreachable
    state: str
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
    pane_lines: list[str] = field(default_factory=list)  # the pane's last lines, any state
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
    served: ServedEval | None = None  # the newest `dflashctl eval` with a summary
    job: RunningJob | None = None  # a `dflashctl eval` or `gate` running there now
    regen: RegenJob | None = None  # the newest `dflashctl regen` job there (any state)
    # the newest checkpoint the trainer could not write (none written since), and why
    checkpoint_failed: CheckpointFailed | None = None
    # a run file that could not be written (a full disk) and where the truth was read instead
    stale_note: str | None = None

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
        failed = self.checkpoint_failed
        d["checkpoint_failed"] = failed.model_dump() if failed else None
        # the file's keys as read (extras included), not the model's defaults
        d["run_state"] = self.run_state.model_dump(mode="json", exclude_unset=True)
        d["step"] = self.step
        d["finished"] = self.finished
        d["regen"] = self.regen.to_json_dict() if self.regen else None
        d["eval"] = eval_view(self.run_state)
        d["served"] = self.served.to_json_dict() if self.served else None
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


def parse_events(text: str) -> list[Event]:
    """The events of a status.log or pane text, a line each (blank lines skipped)."""
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


def pane_signal(pane_text: str) -> int | None:
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
    agent = _int_or_none(supervisor.fields.get("agent_pid")) if supervisor is not None else None
    mine = run_state.pid in owners or (agent is not None and run_state.parent_pid == agent)
    return mine and run_state.state in {"stopped", "finished"}


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


JOB_KINDS = ("eval", "gate")


def parse_running_job(sections: dict[str, str], session: str) -> RunningJob | None:
    """The status script's job sections (already sanitised) -> the eval or gate job running
    now (the script reports one only while its pane is alive and it has no exit status)."""
    kind, _, jid = sections.get("job", "").strip().partition(" ")
    started = measure_started(jid) if re.match(MEASURE_ID_PATTERN, jid) else None
    if kind not in JOB_KINDS or started is None:
        return None
    now = sections.get("job_now", "").strip()
    lines = [ln.strip() for ln in sections.get("job_progress", "").splitlines() if ln.strip()]
    return RunningJob(
        kind=kind,
        id=jid,
        session=f"{session}-{kind}",
        since=iso_utc(started),
        age_s=max(0.0, int(now) - started) if now.isdigit() else None,
        progress=lines[-1] if lines else None,
    )


def parse_served(sections: dict[str, str]) -> ServedEval | None:
    """The status script's served sections (already sanitised) -> the newest eval with a
    summary; None without one, or with a summary this dflashctl cannot read."""
    sid = sections.get("served_id", "").strip()
    started = measure_started(sid) if re.match(MEASURE_ID_PATTERN, sid) else None
    if started is None:
        return None
    summary, _ = parse_served_summary(sections.get("served", ""))
    if summary is None:
        return None
    info: dict[str, Any] = {}
    with contextlib.suppress(json.JSONDecodeError):
        loaded = json.loads(sections.get("served_info", "") or "{}")
        info = loaded if isinstance(loaded, dict) else {}
    step = info.get("step")
    checkpoint = info.get("checkpoint") or info.get("drafter")
    now = sections.get("served_now", "").strip()
    return ServedEval(
        id=sid,
        since=iso_utc(started),
        summary=summary,
        checkpoint=checkpoint if isinstance(checkpoint, str) else None,
        step=step if isinstance(step, int) and not isinstance(step, bool) else None,
        age_s=max(0.0, int(now) - started) if now.isdigit() else None,
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
    # The capture is taken with -J: tmux already re-joined wrapped rows, so re-joining rows that
    # happen to be exactly the pane width would glue separate lines together.
    pane_events = parse_events(capture)
    stale = stale_state(pane_events) if sup is not None else None
    if sup is not None and stale is not None:  # the file could not be written: the pane wins
        sup = SupervisorFile(stale_supervisor(sup.fields, stale))
    sup_state = sup.state if sup else None
    sig: int | None = None
    if pane is None:
        state, exit_status = "stopped", None
    elif not pane.dead:
        # The pane's process is the supervisor: alive while the trainer under it is restarted.
        # a group node's supervisor also says `rendezvous` (its agent waits for the others)
        state = sup_state if sup_state in {"restarting", "stalled", "rendezvous"} else "running"
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
            sig = pane_signal(s.get("pane", ""))
            if sig is None and sup and isinstance(exit_status, int) and exit_status > 128:
                sig = exit_status - 128  # the supervisor exits 128 + N for a trainer killed by N
    supervisor, restarts = supervisor_view(sup)
    log_events = parse_events(s.get("log", ""))
    # Errors and status of the current run only: status.log keeps every run's lines, the pane
    # only this one's.
    this_run = log_events[current_run_start(log_events) :]
    # a full disk stops status.log first: the pane may be ahead; before this run's first line,
    # the last run's
    last_status = newest_status(this_run, pane_events) or newest_status(log_events)
    last_ckpt = next((e for e in reversed(log_events) if isinstance(e, CheckpointEvent)), None)
    if last_ckpt is None:
        last_ckpt = next((e for e in reversed(pane_events) if isinstance(e, CheckpointEvent)), None)
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
        pane_lines=[ln for ln in capture.splitlines() if ln.strip()][-PANE_LINES:],
        signal=signal_name(sig) if sig is not None else None,
        stop_signal=stop_signal or None,
        run_state_error=run_state_error,
        switch_note=switch_note(s.get("switched", ""), current),
        supervisor=supervisor,
        restarts=restarts,
        supervisor_error=sup_error,
        release_has_supervisor=s.get("supervisable", "").strip() == "yes",
        measure=parse_running_measure(s, session),
        served=parse_served(s),
        job=parse_running_job(s, session),
        regen=parse_regen_job(raw, prefix="regen_"),
        checkpoint_failed=checkpoint_failure(run_state, [*this_run, *pane_events], last_ckpt),
        stale_note=stale_note(stale) if sup is not None and stale is not None else None,
    )


# torchrun's failure report (torch.distributed.elastic's ChildFailedError), one per failed rank:
#   rank      : 1 (local_rank: 0)
#   exitcode  : -9 (pid: 1234)
_TORCHRUN_RANK = re.compile(r"\brank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)")
_TORCHRUN_EXIT = re.compile(r"\bexitcode\s*:\s*(-?\d+)")
# a line that is only a rule (torchrun's `=====` and `-----` around its report)
_RULE = re.compile(r"^[=\-_*#~]+$")


def torchrun_failure(pane_tail: Sequence[str]) -> tuple[int, int] | None:
    """(global rank, exit code) of the first rank torchrun reported failed in this pane."""
    rank: int | None = None
    lines = list(pane_tail)
    # "Failures:" lists the other ranks first; "Root Cause (first observed failure)" is the one
    roots = [i for i, line in enumerate(lines) if "Root Cause" in line]
    for line in lines[roots[-1] :] if roots else lines:
        m = _TORCHRUN_RANK.search(line)
        if m:
            rank = int(m.group(1))
            continue
        e = _TORCHRUN_EXIT.search(line)
        if e and rank is not None:
            return rank, int(e.group(1))
    return None


def last_error_line(log_text: str, capture: str) -> str | None:
    """The run's own ERROR line (status.log, else the pane); else torchrun's report of the rank
    that failed first, in words; else the pane's last line that says something (never a rule
    like torchrun's `=====`, never tmux's own "Pane is dead")."""
    for text in (log_text, capture):
        errors = [e for e in parse_events(text) if isinstance(e, ErrorEvent)]
        if errors:
            return errors[-1].message
    rows = [ln.strip() for ln in capture.splitlines()]
    report = torchrun_failure(rows)
    if report is not None:
        rank, code = report
        how = describe_exit(None, -code) if code < 0 else describe_exit(code, None)
        return f"torchrun: rank {rank} {how} (no error line of its own)"
    said = [r for r in rows if r and not r.startswith("Pane is dead") and not _RULE.match(r)]
    return said[-1] if said else None


def describe_exit(exit_status: int | None, sig: int | None) -> str:
    if sig is not None:
        return f"was killed by {signal_name(sig)} (exit status {128 + sig})"
    if exit_status is None:
        return "exited (no exit status)"
    what = {
        1: " (failed)",
        2: " (refused: a user error)",
        3: " (checkpoints kept failing: stopped rather than train what cannot be kept)",
    }.get(exit_status, "")
    return f"exited with status {exit_status}{what}"
