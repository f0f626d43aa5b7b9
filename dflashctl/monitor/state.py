"""Per-host run state for the TUI, with no Textual imports.

Two halves:

* a pure reducer: `apply_line` / `apply_event` / `apply_status` fold `trainer.events` events and
  `RunControl.status()` results into an immutable `RunState`, so replayed status lines give the
  exact state a live stream gives, and every pane is a pure function of one `RunState`;
* `HostFollower` (`monitor.follower`): one async task per host that follows status.log through the one follow loop
  (`dflashctl.runs.follow.LogFollower`, typed events, one backoff) and polls `status()` and `gpus()`
  (with GPU health where the control reports it, and the node's kernel log for Xids where its
  transport can run commands on the node: the first read is history, later Xids are news).
  It never touches widgets; it publishes each new `RunState` through a callback, and the app
  coalesces those into a few redraws a second.

What the run's plan is (total steps, end step, warmup, bucket edges) comes from the trainer's
run-state.json (`trainer.events.run_state.RunState`, via the status poll): this side never
re-derives what the trainer decided; before the trainer has written it, it is unknown.

The rest of the folder: `plan` (the run's shape: queue capacities, steps, LR, bucket edges),
`evals` (held-out results), `restart_plan` (the r key's diff and verdict) and `follower`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeVar

from pydantic import ValidationError

from dflashctl.alerts.gpu_events import GpuEventKind, gpu_events
from dflashctl.gpus.nvidia_smi import GpuHealth, GpuSample
from dflashctl.gpus.xid_log import Xid, xid_wall_time
from dflashctl.humanize import format_age
from dflashctl.runs.regen_view import RegenJob
from dflashctl.runs.snapshot import (
    RunningMeasure,
    ServedEval,
    restart_reason,
    restart_time,
    run_finished,
)
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
    pass

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
    names the rank that failed (`dflashctl.runs.snapshot.torchrun_failure`)."""
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
    served: ServedEval | None = None
    """The newest `dflashctl eval` with a summary (status `served`): served tau beside the
    in-training tau in the eval pane; kept through unreachable polls."""
    regen: RegenJob | None = None
    """The host's newest `dflashctl regen` job (status `regen`), any state; kept through
    unreachable polls."""


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
    @property
    def served(self) -> ServedEval | None: ...
    @property
    def regen(self) -> RegenJob | None: ...


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
    measure, served, regen = status.measure, status.served, status.regen
    if run == "unreachable":  # what we knew stays shown: the link is down, not the run
        restarts, supervisor, pane_tail = state.restarts, state.supervisor, state.pane_tail
        measure, served, regen = state.measure, state.served, state.regen
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
        served=served,
        regen=regen,
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
    the last run's end was: its devices are busy; one running a `dflashctl regen` job and no
    training run is "regenerating".
    """
    if state.run == "unreachable":
        return "unreachable"
    if state.measure is not None and state.run not in {
        "running",
        "restarting",
        "stalled",
        "rendezvous",
    }:
        return "measuring"
    if (
        state.regen is not None
        and state.regen.live
        and state.run not in {"running", "restarting", "stalled"}
    ):
        return "regenerating"
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


def bucket_labels(boundaries: Sequence[int] | None, count: int) -> list[str]:
    """Length-range labels for the q_pre gauges: `[0,770)` ... from K+1 bucket edges.

    Falls back to `b0..bN` when the boundaries are unknown or do not match the queue count.
    """
    if boundaries is not None and len(boundaries) == count + 1:
        return [f"[{boundaries[i]},{boundaries[i + 1]})" for i in range(count)]
    return [f"b{i}" for i in range(count)]
