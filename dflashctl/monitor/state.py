"""Per-host run state for the TUI, with no Textual imports.

Two halves:

* a pure reducer: `apply_line` / `apply_event` / `apply_status` fold `trainer.events` events and
  `RunControl.status()` results into an immutable `RunState`, so replayed status lines give the
  exact state a live stream gives, and every pane is a pure function of one `RunState`;
* `HostFollower`: one async task per host that follows status.log through the one follow loop
  (`dflashctl.runs.follow.LogFollower`, typed events, one backoff) and polls `status()` and `gpus()`
  (with GPU health where the control reports it, and the node's kernel log for Xids where its
  transport can run commands on the node: the first read is history, later Xids are news).
  It never touches widgets; it publishes each new `RunState` through a callback, and the app
  coalesces those into a few redraws a second.

What the run's plan is (total steps, end step, warmup, bucket edges) comes from the trainer's
run-state.json (`trainer.events.run_state.RunState`, via the status poll): this side never
re-derives what the trainer decided; before the trainer has written it, it is unknown.

Plus the restart plan (`plan_restart`): the unified diff between the deployed and the local run
config and whether the restart can resume or must start fresh (and which keys force that).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar, runtime_checkable

from pydantic import ValidationError

from dflashctl.alerts.gpu_events import GpuEventKind, gpu_events
from dflashctl.gpus.nvidia_smi import GpuHealth, GpuSample
from dflashctl.gpus.xid_log import Xid, xid_wall_time
from dflashctl.gpus.xid_reader import XidReader
from dflashctl.remote.transport import Transport
from dflashctl.runs.follow import (
    Backoff,
    Connected,
    FollowEvent,
    Line,
    LogFollower,
    LogRestarted,
    LogSource,
    Lost,
    any_failure,
    describe_failure,
)
from dflashctl.runs.snapshot import RunningMeasure, restart_reason, restart_time, run_finished
from trainer.events import (
    BUCKET_LOSS_KEY,
    CheckpointEvent,
    ErrorEvent,
    EvalEvent,
    Event,
    PhaseEvent,
    StatusEvent,
    format_line,
    parse_bucket_losses,
    parse_line,
)
from trainer.events import run_state as contract

if TYPE_CHECKING:
    from dflashctl.releases.resume import CheckpointConfig

HISTORY = 180
"""Points kept per history series (sparklines): 180 status lines is 15 min at one line per 5 s."""
LOG_TAIL = 400
"""Raw lines kept per host; the full log screen re-reads nothing, so this bounds memory."""
STALE_AFTER_S = 60.0
"""A running host whose last line is older than this is shown as stale (with its age)."""
DASH = "—"
XID_KEEP = 32
"""Xids kept per host (newest last); the GPU pane shows the newest few."""
T = TypeVar("T")

LinkState = Literal["connecting", "live", "retrying"]


@dataclass(frozen=True, slots=True)
class SeenXid:
    """One Xid line of the node's kernel log as the TUI saw it."""

    xid: Xid
    at: float
    """When it happened: the log's own time where its stamp has one (journalctl), else when the
    follower first read it (dmesg stamps count seconds since boot)."""
    history: bool
    """In the follower's first read: it happened before this view watched, so it is shown as
    history and never toasted."""


@dataclass(frozen=True, slots=True)
class RunState:
    """Everything the TUI shows about one host. Immutable: reducers return a new one."""

    host: str
    run: str = "unknown"
    """From `RunControl.status()`: running, restarting, stalled, stopped, crashed, gave-up,
    unreachable, or unknown (not yet)."""
    exit_status: int | None = None
    release: str | None = None
    config_hash: str | None = None
    link: LinkState = "connecting"
    """State of our stream to the host, independent of the run's own state."""
    link_error: str | None = None
    retry_at: float | None = None
    """Wall-clock time of the next reconnect attempt while `link == "retrying"`."""
    last_line_at: float | None = None
    """Wall-clock time the last status.log line arrived (drives the age and staleness)."""
    lines_seen: int = 0
    """status.log lines consumed; a reconnect follows from here so nothing is counted twice."""
    status: StatusEvent | None = None
    phase: str | None = None
    checkpoint: tuple[int, str] | None = None
    last_error: str | None = None
    ktok_hist: tuple[float, ...] = ()
    loss_hist: tuple[float, ...] = ()
    acc_hist: tuple[float, ...] = ()
    streak_hist: tuple[float, ...] = ()
    q_pre_hist: tuple[tuple[int, ...], ...] = ()
    q_hs_hist: tuple[tuple[int, ...], ...] = ()
    loss_points: tuple[tuple[int, float], ...] = ()
    """(step, loss) of each status line with a loss: the loss chart's x axis is the step."""
    bucket_loss_hist: tuple[tuple[int, tuple[float | None, ...]], ...] = ()
    """(step, mean loss per length bucket) from each status line's `loss_b=[...]` extra; None
    for a bucket that had no batch in the interval."""
    evals: tuple[EvalEvent, ...] = ()
    """Held-out evaluations (`Eval:` lines) in the order they arrived, at most HISTORY."""
    last_eval_at: float | None = None
    """Wall-clock time the last `Eval:` line arrived (the eval pane's age)."""
    log_tail: tuple[str, ...] = ()
    gpus: tuple[GpuSample, ...] = ()
    gpu_health: tuple[GpuHealth, ...] = ()
    """ECC counts and clock-event (throttle) reasons per GPU, where the control reports them
    (`HealthSource`); matched to `gpus` by index."""
    xids: tuple[SeenXid, ...] = ()
    """Xid lines from the node's kernel log (`gpu_health.parse_xid_lines`), oldest first, at
    most XID_KEEP; each once (by `Xid.key`)."""
    unreachable_since: float | None = None
    """When the host was first seen unreachable in this outage (None while reachable)."""
    pane_tail: tuple[str, ...] = ()
    """A dead pane's last lines (status `pane_tail`): in a group, torchrun's failure report
    names the rank that failed (`dflashctl.groups.state.torchrun_failure`)."""
    run_info: contract.RunState = field(default_factory=contract.RunState)
    """RUN/run-state.json as last polled: the trainer's plan (total_steps, end_step,
    warmup_steps, boundaries) once it has written it."""
    config_changed: bool = False
    config_note: str | None = None
    """Why the config comparison could not be made (e.g. local file unreadable), if it could not."""
    restarts: tuple[dict[str, Any], ...] = ()
    """The supervisor's restart records (status `restarts`), oldest first; kept while unreachable."""
    supervisor: dict[str, Any] | None = None
    """status `supervisor` (policy, state, gave_up, detail) of the pane's run, if supervised."""
    measure: RunningMeasure | None = None
    """The `dflashctl measure` running on the host (status `measure`): set while a poll reports
    it, gone with the first reachable poll that does not; kept through unreachable polls."""


def _push(hist: tuple[T, ...], value: T, limit: int = HISTORY) -> tuple[T, ...]:
    if len(hist) >= limit:
        return (*hist[len(hist) - limit + 1 :], value)
    return (*hist, value)


def _push_opt(hist: tuple[float, ...], value: float | None) -> tuple[float, ...]:
    return hist if value is None else _push(hist, float(value))


def apply_event(state: RunState, event: Event, now: float, line: str | None = None) -> RunState:
    """Fold one parsed status.log event into the state (pure); `line` is its raw text."""
    log_tail = _push(state.log_tail, line if line is not None else format_line(event), LOG_TAIL)
    base = replace(state, log_tail=log_tail, last_line_at=now, lines_seen=state.lines_seen + 1)
    if isinstance(event, StatusEvent):
        raw_b = event.extra.get(BUCKET_LOSS_KEY)
        per_bucket = parse_bucket_losses(raw_b) if raw_b is not None else None
        return replace(
            base,
            status=event,
            phase="running",
            ktok_hist=_push_opt(state.ktok_hist, event.ktok_s),
            loss_hist=_push_opt(state.loss_hist, event.loss),
            loss_points=state.loss_points
            if event.loss is None
            else _push(state.loss_points, (event.step, float(event.loss))),
            bucket_loss_hist=state.bucket_loss_hist
            if not per_bucket
            else _push(state.bucket_loss_hist, (event.step, tuple(per_bucket))),
            acc_hist=_push_opt(state.acc_hist, event.acc),
            streak_hist=_push_opt(state.streak_hist, event.streak),
            q_pre_hist=_push(state.q_pre_hist, tuple(event.q_pre)),
            q_hs_hist=_push(state.q_hs_hist, tuple(event.q_hs)),
        )
    if isinstance(event, PhaseEvent):
        # A new run's first phase line: an earlier run's error is not this run's (the rule
        # dflashctl.runs.control.current_run_start applies to status).
        new_run = event.phase == "loading" or (
            event.phase == "starting" and state.phase not in {"loading", "resuming"}
        )
        return replace(base, phase=event.phase, last_error=None if new_run else state.last_error)
    if isinstance(event, CheckpointEvent):
        return replace(base, checkpoint=(event.step, event.path))
    if isinstance(event, EvalEvent):
        return replace(base, evals=_push(state.evals, event), last_eval_at=now)
    if isinstance(event, ErrorEvent):
        # an error ends a run's setup: a "starting" line after it opens the next run
        return replace(base, last_error=event.message, phase=None)
    return base


def apply_line(state: RunState, line: str, now: float) -> RunState:
    """Parse one status.log line and fold it in. Never raises (the parser never does)."""
    line = line.rstrip("\n")
    return apply_event(state, parse_line(line), now, line)


def apply_lines(state: RunState, lines: Iterable[str], now: float) -> RunState:
    """Fold a replayed block of lines (e.g. a whole status.log) in order."""
    for line in lines:
        state = apply_line(state, line, now)
    return state


class StatusView(Protocol):
    """What the reducer reads of a `dflashctl.runs.control.RunStatus` (test doubles have the same)."""

    @property
    def state(self) -> str: ...
    @property
    def exit_status(self) -> int | None: ...
    @property
    def release(self) -> str | None: ...
    @property
    def config_hash(self) -> str | None: ...
    @property
    def message(self) -> str | None: ...
    @property
    def run_state(self) -> contract.RunState | Mapping[str, object]: ...
    @property
    def restarts(self) -> Sequence[object]: ...
    @property
    def supervisor(self) -> Mapping[str, Any] | None: ...
    @property
    def log_lines(self) -> int | None: ...
    @property
    def pane_tail(self) -> Sequence[str]: ...
    @property
    def measure(self) -> RunningMeasure | None: ...


def as_run_state(raw: contract.RunState | Mapping[str, object] | None) -> contract.RunState:
    """The typed run-state of a status poll (a mapping, from a double, is validated the same
    way; one that does not validate is an unwritten run-state, never half-read)."""
    if isinstance(raw, contract.RunState):
        return raw
    try:
        return contract.RunState.model_validate(dict(raw or {}))
    except ValidationError:
        return contract.RunState()


def apply_status(state: RunState, status: StatusView) -> RunState:
    """Fold a `RunControl.status()` result (a `RunStatus`) into the state.

    A poll that found no run-state.json keeps the one seen before (the trainer's plan does not
    go away because one read came back empty). A running measure is what the poll says (the
    status script reads it in the same round trip): none reported, none shown.
    """
    run = status.state
    restarts: tuple[dict[str, Any], ...]
    pane_tail = tuple(status.pane_tail or ())
    measure = status.measure
    if run == "unreachable":  # what we knew stays shown: the link is down, not the run
        restarts, supervisor, pane_tail = state.restarts, state.supervisor, state.pane_tail
        measure = state.measure
    else:
        restarts = tuple(dict(r) for r in status.restarts or () if isinstance(r, Mapping))
        sup = status.supervisor
        supervisor = dict(sup) if isinstance(sup, Mapping) else None
    info = as_run_state(status.run_state)
    return replace(
        state,
        run=run,
        link_error=status.message if run == "unreachable" else state.link_error,
        exit_status=status.exit_status,
        release=status.release or state.release,
        config_hash=status.config_hash or state.config_hash,
        run_info=info if info.model_fields_set else state.run_info,
        restarts=restarts,
        supervisor=supervisor,
        pane_tail=pane_tail,
        measure=measure,
    )


def restart_summary(state: RunState, now: float, compact: bool = False) -> str | None:
    """Restart count, last reason and its age: `2× signal 9, 3m05s ago` (host header) or
    `2× signal 9 3m05s` (`compact`, the fleet row); None without restarts."""
    if not state.restarts:
        return None
    last = state.restarts[-1]
    at = restart_time(last)
    age = DASH if at is None else format_age(max(0.0, now - at))
    head = f"{len(state.restarts)}× {last.get('reason') or '?'}"
    return f"{head} {age}" if compact else f"{head}, {age} ago"


def supervisor_events(old: RunState, new: RunState) -> list[tuple[str, str]]:
    """(severity, text) of each supervisor event `new` adds to `old`: one toast per restart,
    one for giving up. A host's first poll is its history, not news; a shorter list (a new
    run) re-baselines."""
    if old.run == "unknown" or new.run == "unreachable":
        return []
    out: list[tuple[str, str]] = []
    if len(new.restarts) > len(old.restarts):
        policy = (new.supervisor or {}).get("policy") or {}
        limit = policy.get("max_restarts", "?") if isinstance(policy, dict) else "?"
        for n, r in enumerate(new.restarts[len(old.restarts) :], start=len(old.restarts) + 1):
            out.append(
                (
                    "warning",
                    f"{new.host}: trainer restarted ({restart_reason(r)}); restart {n} of {limit}",
                )
            )
    if new.run == "gave-up" and old.run != "gave-up":
        detail = (new.supervisor or {}).get("detail")
        out.append(("error", f"{new.host}: supervisor {detail or 'gave up'}"))
    return out


def apply_xids(
    state: RunState, xids: Iterable[Xid], now: float, *, history: bool = False
) -> RunState:
    """Fold the Xids of one kernel-log read in (pure): each key once, the newest XID_KEEP kept.
    `history`: the first read, whose Xids predate the view."""
    known = {s.xid.key for s in state.xids}
    out = state.xids
    for x in xids:
        if x.key in known:
            continue
        known.add(x.key)
        at = xid_wall_time(x)
        out = _push(out, SeenXid(x, now if at is None else at, history), XID_KEEP)
    return state if out is state.xids else replace(state, xids=out)


def xid_text(state: RunState, x: Xid) -> str:
    """`GPU 0: Xid 79 (GPU has fallen off the bus), process python (pid 41233): ...`: the
    watch's wording (`gpu_health.gpu_events`), the GPU found by bus id in the health rows."""
    rows = state.gpu_health
    same = {h.index: h for h in rows}  # one reading against itself: only the Xid is news
    events = gpu_events(same, rows, [x])
    return next(e.detail for e in events if e.kind is GpuEventKind.XID)


def xid_events(old: RunState, new: RunState) -> list[tuple[str, str]]:
    """(severity, text) of each Xid `new` adds to `old` that is not history: one toast each."""
    known = {s.xid.key for s in old.xids}
    return [
        ("error", f"{new.host}: {xid_text(new, s.xid)}")
        for s in new.xids
        if not s.history and s.xid.key not in known
    ]


def mark_reachability(state: RunState, now: float) -> RunState:
    """Set `unreachable_since` when the host becomes unreachable (kept through the outage),
    clear it when it is reachable again (pure)."""
    down = state.run == "unreachable" or state.link == "retrying"
    if down and state.unreachable_since is None:
        return replace(state, unreachable_since=now)
    if not down and state.unreachable_since is not None:
        return replace(state, unreachable_since=None)
    return state


def start_new_run(state: RunState) -> RunState:
    """After a fresh restart: drop the old run's histories (the trainer keeps appending to the
    same status.log, so the line count, and the follow position, carry on)."""
    return replace(
        state,
        status=None,
        checkpoint=None,
        last_error=None,
        ktok_hist=(),
        loss_hist=(),
        acc_hist=(),
        streak_hist=(),
        q_pre_hist=(),
        q_hs_hist=(),
        loss_points=(),
        bucket_loss_hist=(),
        evals=(),
        last_eval_at=None,
    )


def apply_link(
    state: RunState, link: LinkState, error: str | None = None, retry_at: float | None = None
) -> RunState:
    """Record the state of our stream to the host (pure)."""
    return replace(state, link=link, link_error=error, retry_at=retry_at)


def display_state(state: RunState, now: float, stale_after: float = STALE_AFTER_S) -> str:
    """The one-word state a fleet row shows, honest about what we do not know.

    A run that says "running" but has sent nothing for `stale_after` seconds is "stale"; a host we
    cannot reach is "unreachable" whatever its last known run state was. A host running a
    `dflashctl measure` (and no training run: they refuse each other) is "measuring", whatever
    the last run's end was: its devices are busy.
    """
    if state.run == "unreachable":
        return "unreachable"
    if state.measure is not None and state.run not in {"running", "restarting", "stalled"}:
        return "measuring"
    if state.run == "gave-up":
        return "gave-up"
    if state.run == "crashed":
        code = "?" if state.exit_status is None else str(state.exit_status)
        return f"crashed (exit {code})"
    if state.run == "stopped":
        return (
            "finished" if run_finished(state.run, state.exit_status, state.run_info) else "stopped"
        )
    if state.link == "retrying":
        return "unreachable"
    if state.run == "running":
        age = line_age(state, now)
        return "stale" if age is not None and age > stale_after else "running"
    if state.run in {"restarting", "stalled"}:
        return state.run
    return "connecting" if state.link == "connecting" else state.run


def line_age(state: RunState, now: float) -> float | None:
    """Seconds since the last line, or None when no line has arrived yet."""
    return None if state.last_line_at is None else max(0.0, now - state.last_line_at)


def format_age(seconds: float | None) -> str:
    """Compact age: 4s, 2m05s, 3h12m, 2d04h; an em dash when there is none."""
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"


def bucket_labels(boundaries: Sequence[int] | None, count: int) -> list[str]:
    """Length-range labels for the q_pre gauges: `[0,770)` ... from K+1 bucket edges.

    Falls back to `b0..bN` when the boundaries are unknown or do not match the queue count.
    """
    if boundaries is not None and len(boundaries) == count + 1:
        return [f"[{boundaries[i]},{boundaries[i + 1]})" for i in range(count)]
    return [f"b{i}" for i in range(count)]


@dataclass(frozen=True, slots=True)
class RunShape:
    """What the local run config states and panes need: the queue capacities, the epoch count,
    the LR schedule, and the values the config gives explicitly (bucket edges as a list,
    schedule.max_steps, schedule.warmup_steps). The trainer's own figures (run-state.json)
    win over those; nothing here is derived from the config the way the trainer derives it."""

    boundaries: tuple[int, ...] | None = None
    q_pre_capacity: int | None = None
    q_hs_capacity: int | None = None
    warmup_steps: int | None = None
    total_steps: int | None = None
    epochs: float | None = None
    schedule: Callable[[int, int, int], float] | None = None
    """LR at (step, warmup_steps, total_steps): the trainer's own schedule, so the curve drawn is
    the one it follows."""


def shape_from_config(path: Path) -> RunShape:
    """The panes' view of a run config: explicit bucket edges, queue capacities, the LR schedule.

    An unreadable or invalid config gives an empty shape (the panes then show what status lines
    alone tell); the restart modal is where config errors are reported. Planned edges
    (`boundaries = "plan"`) are the trainer's to say, in run-state.json.
    """
    from trainer.config import ConfigError, TrainConfig

    try:
        cfg = TrainConfig.load(path)
    except ConfigError:
        return RunShape()
    bounds = cfg.batching.boundaries
    sched = cfg.schedule
    return RunShape(
        boundaries=tuple(bounds) if isinstance(bounds, list) else None,
        q_pre_capacity=cfg.topology.prefetch_depth,
        q_hs_capacity=cfg.topology.hidden_depth,
        warmup_steps=sched.warmup_steps,
        total_steps=sched.max_steps,
        epochs=sched.epochs,
        schedule=lr_schedule(cfg.optimizer.lr, sched.min_lr),
    )


def lr_schedule(peak: float, floor: float) -> Callable[[int, int, int], float]:
    """The trainer's own LR schedule (torch-free `trainer.config.schedule.lr_at`) bound to a
    config's peak and floor, so the curve drawn is the one the run follows."""
    from trainer.config.schedule import lr_at

    def at(step: int, warmup: int, total: int) -> float:
        return lr_at(step, total_steps=total, warmup_steps=warmup, peak=peak, floor=floor)

    return at


def total_steps(shape: RunShape, state: RunState) -> int | None:
    """Optimizer steps of the whole schedule as the trainer computed them (run-state.json),
    else the config's explicit max_steps; None (unknown) before either says."""
    reported = state.run_info.total_steps
    return reported if reported is not None else shape.total_steps


def end_step(state: RunState) -> int | None:
    """The step the run stops at (the schedule's end, or max_steps), as the trainer said."""
    return state.run_info.end_step


def warmup_steps(shape: RunShape, state: RunState) -> int | None:
    """Warmup length as the trainer computed it (run-state.json), else the config's explicit
    warmup_steps; None (unknown) when neither says: a ratio is the trainer's to apply."""
    reported = state.run_info.warmup_steps
    return reported if reported is not None else shape.warmup_steps


def boundaries(shape: RunShape, state: RunState) -> Sequence[int] | None:
    """Bucket edges: the ones the trainer reports (planned or configured), else the config's
    explicit list; None (b0..bN labels) when neither says."""
    reported = state.run_info.boundaries
    return reported if reported is not None else shape.boundaries


# ----------------------------------------------------------------------------- evaluation


@dataclass(frozen=True, slots=True)
class BestCheckpoint:
    """The best held-out evaluation so far: its step, tau and checkpoint (what is known)."""

    step: int | None
    tau: float | None
    checkpoint: str | None


def last_eval(state: RunState) -> EvalEvent | None:
    """The newest evaluation known: the last `Eval:` line read, or run-state.json's
    `last_eval` when that is newer (the follow started past older lines, or is behind)."""
    seen = state.evals[-1] if state.evals else None
    polled = state.run_info.last_eval
    if polled is not None and (seen is None or polled.step > seen.step):
        return polled
    return seen


def tau_history(state: RunState) -> list[tuple[int, float]]:
    """(step, simulated tau) of each evaluation read (oldest first), plus run-state.json's
    last eval when no line carried it; steps increase (a resume's re-evaluation replaces)."""
    points: dict[int, float] = {}
    evals = list(state.evals)
    newest = last_eval(state)
    if newest is not None and (not evals or newest.step > evals[-1].step):
        evals.append(newest)
    for ev in evals:
        if ev.tau is not None:
            points[ev.step] = ev.tau
    return sorted(points.items())


def best_checkpoint(state: RunState) -> BestCheckpoint | None:
    """The trainer's best (run-state.json: best_step, best_tau, best_checkpoint), else what the
    eval lines say (`best=` of the newest, its tau from the history); None before any eval."""
    info = state.run_info
    if info.best_step is not None:
        tau = info.best_tau
        if tau is None:
            tau = dict(tau_history(state)).get(info.best_step)
        return BestCheckpoint(info.best_step, tau, info.best_checkpoint)
    newest = last_eval(state)
    if newest is None:
        return None
    history = tau_history(state)
    if newest.best is not None:
        return BestCheckpoint(newest.best, dict(history).get(newest.best), None)
    if not history:
        return None
    step, tau = max(history, key=lambda p: (p[1], p[0]))  # ties to the later step
    return BestCheckpoint(step, tau, None)


# ----------------------------------------------------------------------------- restart plan


@dataclass(frozen=True, slots=True)
class RestartPlan:
    """What `r` would do: the diff, and resume vs. fresh with the keys that decide it."""

    diff: str
    fresh: bool
    critical_keys: tuple[str, ...] = ()
    error: str | None = None
    """Set when the local config is invalid: the restart is refused and this says why."""

    @property
    def changed(self) -> bool:
        return bool(self.diff)

    @property
    def verdict(self) -> str:
        if self.error:
            return f"cannot restart: {self.error}"
        if self.fresh:
            return (
                "start FRESH (checkpoints set aside): resume-critical keys changed: "
                + ", ".join(self.critical_keys)
            )
        return "resume from the latest checkpoint (no resume-critical key changed)"


class NotAsked(enum.Enum):
    """`plan_restart` was not told which checkpoint a resume would load."""

    NOT_ASKED = enum.auto()


def plan_restart(
    deployed: str,
    local_path: Path,
    checkpoint: CheckpointConfig | NotAsked | None = NotAsked.NOT_ASKED,
) -> RestartPlan:
    """Decide resume vs. fresh with the same rule `RunControl.restart` enforces.

    `checkpoint` is what `RunControl.checkpoint_config()` found (a CheckpointConfig, or None:
    nothing to resume): the new config is compared with the config saved in the checkpoint a
    resume would load, through `dflashctl.releases.resume` (which defers to
    `trainer.config.resume_critical_changes`), so the modal's verdict and the service's refusal
    can never disagree. Without it (a control that cannot tell), the deployed config stands in.
    An invalid local config refuses the restart and names the problem.
    """
    from dflashctl.config.runconfig import (
        RunConfigError,
        config_diff,
        read_config_text,
        resume_breaking_changes,
        validate_config,
    )
    from dflashctl.releases.resume import breaking_keys

    try:
        local = read_config_text(local_path)
    except RunConfigError as exc:
        return RestartPlan(diff="", fresh=False, error=str(exc))
    diff = config_diff(
        deployed, local, old_name="deployed: run/config.toml", new_name=f"local: {local_path}"
    )
    try:
        validate_config(local_path)
    except RunConfigError as exc:
        return RestartPlan(diff=diff, fresh=False, error=str(exc).replace("\n", " "))
    if checkpoint is NotAsked.NOT_ASKED:
        keys = tuple(resume_breaking_changes(deployed, local_path)) if deployed else ()
    elif checkpoint is None or checkpoint.config is None:
        keys = ()  # no readable checkpoint: there is nothing a fresh start would set aside
    else:
        try:
            keys = tuple(breaking_keys(checkpoint.config, local_path))
        except RunConfigError as exc:
            return RestartPlan(diff=diff, fresh=False, error=str(exc).replace("\n", " "))
    return RestartPlan(diff=diff, fresh=bool(keys), critical_keys=keys)


# ----------------------------------------------------------------------------- follower


class FollowedHost(LogSource, Protocol):
    """The slice of `dflashctl.runs.service.RunService` the follower uses."""

    async def status(self) -> StatusView: ...

    async def gpus(self) -> Sequence[GpuSample]: ...


@runtime_checkable
class HealthSource(Protocol):
    """A control that also reports GPU health (ECC counts, clock-event reasons) through
    `dflashctl.gpus.health`'s query and parser; the follower polls it beside `gpus()`."""

    async def gpu_health(self) -> Sequence[GpuHealth]: ...


@runtime_checkable
class OverTransport(Protocol):
    """A control that runs over a transport (`RunControl`): where that transport can also run
    commands on the node (`NodeCommands`), the follower reads the node's kernel log for Xids."""

    @property
    def transport(self) -> Transport: ...


@dataclass
class HostFollower:
    """Keeps one host's `RunState` current over a `FollowedHost`; isolates that host's failures.

    The stream is the one follow loop (`dflashctl.runs.follow.LogFollower`, which owns the read
    position): any failure is a lost link, retried after `backoff` so the UI can show
    "retry in Ns", and `reconnect_now` connects again at once. The status and GPU pollers run
    beside it. `publish` is called with every new state and must be cheap: the app stores it
    and marks the host dirty.
    """

    host: str
    control: FollowedHost
    publish: Callable[[RunState], None]
    clock: Callable[[], float] = time.time
    backoff: Backoff = field(default_factory=Backoff)
    status_every: float = 5.0
    gpu_every: float = 10.0
    call_timeout: float = 20.0
    state: RunState = field(init=False)
    _log: LogFollower | None = field(init=False, default=None)
    _xids: XidReader = field(init=False, default_factory=XidReader)
    """The node's kernel log (`dflashctl.gpus.xids`, the watch's reader too): each Xid once."""

    def __post_init__(self) -> None:
        self.state = RunState(host=self.host)

    def _set(self, state: RunState) -> None:
        state = mark_reachability(state, self.clock())
        self.state = state
        self.publish(state)

    def reconnect_now(self) -> None:
        """Drop the current stream (and any backoff wait) and follow again immediately."""
        if self._log is not None:
            self._log.reconnect_now()

    def mark_config(self, changed: bool, note: str | None = None) -> None:
        self._set(replace(self.state, config_changed=changed, config_note=note))

    def new_run(self) -> None:
        """A fresh run started: its curves must not continue the old run's."""
        self._set(start_new_run(self.state))

    def reset_stream(self) -> None:
        """Forget what was read: after a fresh restart status.log starts over."""
        self._set(replace(self.state, lines_seen=0))
        if self._log is not None:
            self._log.restart()

    async def poll_status(self) -> None:
        """One status poll; failures mark the host unreachable instead of raising."""
        mark = self._log.mark() if self._log is not None else None
        try:
            status = await asyncio.wait_for(self.control.status(), self.call_timeout)
        except Exception as exc:  # any failure of one host is that host's state, not a crash
            self._set(replace(self.state, run="unreachable", link_error=describe_failure(exc)))
            return
        self._set(apply_status(self.state, status))
        reachable = self.state.run not in {"unreachable", "unknown"}
        if reachable and mark is not None and self._log is not None:
            log_lines = status.log_lines
            if isinstance(log_lines, int) and log_lines >= 0:  # shrank: a fresh run started it
                self._log.saw_line_count(log_lines, mark)

    async def _skip_to_what_is_shown(self) -> None:
        """Start the first follow LOG_TAIL lines before the end of status.log, not at line 1.

        The panes keep at most LOG_TAIL lines (and HISTORY <= LOG_TAIL points), so replaying a
        days-long log from its first line costs a full transfer and parse for nothing.
        """
        if self.state.lines_seen:
            return
        try:  # only the line count; the status poller publishes what it finds
            status = await asyncio.wait_for(self.control.status(), self.call_timeout)
        except Exception:  # an unreachable host: the follow and the poller will say so
            return
        total = status.log_lines
        if isinstance(total, int) and total > LOG_TAIL and not self.state.lines_seen:
            self._set(replace(self.state, lines_seen=total - LOG_TAIL))

    async def poll_gpus(self) -> None:
        with contextlib.suppress(Exception):
            gpus = await asyncio.wait_for(self.control.gpus(), self.call_timeout)
            self._set(replace(self.state, gpus=tuple(gpus)))
        control = self.control
        if self.state.gpus and isinstance(control, HealthSource):  # asked only with GPUs
            with contextlib.suppress(Exception):
                health = await asyncio.wait_for(control.gpu_health(), self.call_timeout)
                self._set(replace(self.state, gpu_health=tuple(health)))
        if self.state.gpus:
            with contextlib.suppress(Exception):
                await self.poll_xids()

    async def poll_xids(self) -> None:
        """One read of the node's kernel log: the first read's Xids are history, later reads
        add each Xid not in the read before (the windows overlap) as news."""
        transport = self.control.transport if isinstance(self.control, OverTransport) else None
        if transport is None:
            return
        read = await self._xids.read(transport, self.call_timeout)
        if read is not None and read.fresh:
            self._set(apply_xids(self.state, read.fresh, self.clock(), history=read.history))

    async def _on_event(self, event: FollowEvent) -> None:
        state = self.state
        if isinstance(event, Line):
            if state.link != "live":
                state = apply_link(state, "live")
            state = apply_line(state, event.text, self.clock())
            self._set(replace(state, lines_seen=event.number + 1))
        elif isinstance(event, Connected):
            self._set(apply_link(state, "connecting"))
            if state.link == "retrying":  # back after a wait: say what the run did meanwhile
                await self.poll_status()
        elif isinstance(event, Lost):
            retry_at = self.clock() + event.retry_in
            self._set(apply_link(state, "retrying", event.reason, retry_at))
        elif isinstance(event, LogRestarted):  # status.log is read again from its first line
            self._set(replace(state, lines_seen=0))

    async def _poll_loop(self, every: float, poll: Callable[[], Awaitable[None]]) -> None:
        while True:
            await poll()
            await asyncio.sleep(every)

    async def run(self) -> None:
        """Follow forever (until cancelled): the follow loop's events fold into the state."""
        await self._skip_to_what_is_shown()
        log = LogFollower(
            self.control,
            self.state.lines_seen,
            delay=self.backoff.delay,
            retryable=any_failure,
            name=self.host,
        )
        self._log = log
        pollers = [
            asyncio.create_task(self._poll_loop(self.status_every, self.poll_status)),
            asyncio.create_task(self._poll_loop(self.gpu_every, self.poll_gpus)),
        ]
        try:
            async for event in log.events():
                await self._on_event(event)
        finally:
            self._log = None
            for task in pollers:
                task.cancel()
            await asyncio.gather(*pollers, return_exceptions=True)


if TYPE_CHECKING:
    from dflashctl.runs.control import RunControl
    from dflashctl.runs.service import RunService

    def _slices(service: RunService, control: RunControl) -> tuple[FollowedHost, FollowedHost]:
        return service, control  # both serve a follower (checked by mypy)
