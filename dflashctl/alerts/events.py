"""Watch events: successive per-host status snapshots -> one event per state change (pure).

`dflashctl watch` polls every host, turns each poll into a `HostSnapshot` (`snapshot_from_status`
reads the `status --json` dict, so this module does not depend on `control`'s internals), and
folds them with `derive`, which returns the new `WatchState` and the events to print and notify.

Rules (issue 12 item 4):
- A host that cannot be reached is only ever "unreachable since T": an unreachable poll never
  changes the host's last known condition and never yields crashed/stalled/...; once it has
  lasted `unreachable_alert_s` one UNREACHABLE event is emitted, and RECOVERED when a poll
  reaches the host again (a shorter outage emits nothing at all).
- Conditions: ALERTS (crashed, stalled, gave-up, nonfinite) are emitted when entered; RECOVERED
  follows when the host leaves them for running or stopped. `restarting` keeps an alert open
  (the run is not back yet); `finished` is emitted and closes an open alert.
- Each restart record the supervisor adds is one RESTARTED event with its reason; a shorter list
  (a fresh run) only re-baselines.
- Low disk (the supervisor's `low_disk` entry: RUN has less free than the checkpoints its
  retention keeps, or one checkpoint where the supervisor knew no retention) is one
  LOW_DISK event when it appears and one RECOVERED when it goes; it is no condition of its own
  (the trainer keeps running), so it never opens or closes a condition's alert.
- A checkpoint the trainer could not write (status --json `checkpoint_failed`: run-state, or
  the pane's error line when the disk is too full for run-state) is one CHECKPOINT_FAILED event
  per failed step, and one RECOVERED when a later checkpoint is written; like low disk it opens
  no condition (the trainer stops by itself after two unsaved intervals: a crash, exit 3).
- A regeneration job (status --json `regen`, the host's newest) that ends is one REGEN_FINISHED
  (exit 0) or REGEN_FAILED (gave up, failed, lost) event, once per job; one that was already
  over when the watch first saw it is history. It is no condition of the run's.
- A host seen for the first time reports only an alert it is already in (a crashed host at
  watch start is news, and so is a failing checkpoint), never its history.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

__all__ = [
    "ALERT_CONDITIONS",
    "Condition",
    "EventKind",
    "HostSnapshot",
    "HostTrack",
    "Restart",
    "WatchEvent",
    "WatchState",
    "derive",
    "format_event_line",
    "snapshot_from_status",
]

DEFAULT_UNREACHABLE_ALERT_S = 300.0
NONFINITE_MARK = "non-finite losses in a row"  # the trainer's stop line (trainer.pipeline.runner)


class Condition(StrEnum):
    """What a reachable poll says about a host's run."""

    RUNNING = "running"
    RESTARTING = "restarting"
    STOPPED = "stopped"  # by the operator, or never started
    FINISHED = "finished"
    CRASHED = "crashed"
    STALLED = "stalled"
    GAVE_UP = "gave-up"
    NONFINITE = "nonfinite"


ALERT_CONDITIONS = frozenset(
    {Condition.CRASHED, Condition.STALLED, Condition.GAVE_UP, Condition.NONFINITE}
)
_CLEARING = frozenset({Condition.RUNNING, Condition.STOPPED})


class EventKind(StrEnum):
    CRASHED = "crashed"
    RESTARTED = "restarted"
    STALLED = "stalled"
    GAVE_UP = "gave-up"
    NONFINITE = "nonfinite"
    FINISHED = "finished"
    UNREACHABLE = "unreachable"
    RECOVERED = "recovered"
    LOW_DISK = "low-disk"  # RUN has less free space than one checkpoint (supervisor.json)
    CHECKPOINT_FAILED = "checkpoint-failed"  # a checkpoint was not written (run-state, pane)
    # from dflashctl.gpus.health (`as_watch_events`): already once per change of a reading
    GPU_ERROR = "gpu-error"  # uncorrected ECC errors rose, an Xid
    GPU_THROTTLED = "gpu-throttled"  # a harmful clock-event reason became active
    GPU_CLEARED = "gpu-cleared"  # ... and stopped
    REGEN_FINISHED = "regen-finished"  # a regeneration job ended with every row done
    REGEN_FAILED = "regen-failed"  # ... gave up, failed or was lost


_EVENT_OF: dict[Condition, EventKind] = {
    Condition.CRASHED: EventKind.CRASHED,
    Condition.STALLED: EventKind.STALLED,
    Condition.GAVE_UP: EventKind.GAVE_UP,
    Condition.NONFINITE: EventKind.NONFINITE,
    Condition.FINISHED: EventKind.FINISHED,
}


@dataclass(frozen=True)
class Restart:
    """One restart the supervisor recorded (run-state.json `restarts`)."""

    at: float | None
    reason: str  # "exit 1" | "signal 9" | "stalled 900 s" | "oom"
    exit_status: int | None = None
    resumed_step: int | None = None  # null in supervisor.json until the new attempt says
    checkpoint_step: int | None = None  # the newest checkpoint before the restart


@dataclass(frozen=True)
class HostSnapshot:
    """One poll of one host, as the watch needs it."""

    host: str
    at: float  # when the poll completed (epoch seconds)
    reachable: bool
    condition: Condition | None = None  # None when unreachable
    exit_status: int | None = None
    step: int | None = None
    detail: str | None = None  # last error / stall detail, shown with the event
    restarts: tuple[Restart, ...] = ()
    low_disk: str | None = None  # "0.5 MiB free, checkpoint needs 1.0" while the disk is low
    checkpoint_failed: int | None = None  # the step of the newest checkpoint not written
    checkpoint_failure: str | None = None  # "step 15 not written to RUN/checkpoints: ..."
    regen: tuple[str, str, str] | None = None  # the newest regeneration job: (id, state, detail)


@dataclass(frozen=True)
class HostTrack:
    condition: Condition | None = None  # last reachable condition
    open_alert: Condition | None = None  # an alert sent and not yet recovered
    restarts_seen: int = 0
    unreachable_since: float | None = None
    unreachable_alerted: bool = False
    step: int | None = None
    low_disk: bool = False
    checkpoint_failed: int | None = None  # the failed step already reported
    regen: tuple[str, str] | None = None  # the newest regeneration job seen: (id, state)


@dataclass(frozen=True)
class WatchState:
    hosts: Mapping[str, HostTrack] = field(default_factory=dict)


@dataclass(frozen=True)
class WatchEvent:
    host: str
    kind: EventKind
    at: float
    detail: str = ""  # human text: "exit 1", "signal 9 (resumed from step 1200)", ...
    condition: Condition | None = None  # the condition entered (or, for RECOVERED, left)
    since: float | None = None  # UNREACHABLE: since when; RECOVERED from unreachable: too
    step: int | None = None


def derive(
    state: WatchState,
    snapshots: Iterable[HostSnapshot],
    now: float,
    unreachable_alert_s: float = DEFAULT_UNREACHABLE_ALERT_S,
) -> tuple[WatchState, list[WatchEvent]]:
    """Fold one round of polls into the state; the events, in snapshot order.

    Hosts with no snapshot this round keep their track; an unreachable one still gets its
    UNREACHABLE event once `now` passes its grace (a poll that hangs must not hide an outage).
    """
    hosts = dict(state.hosts)
    events: list[WatchEvent] = []
    seen: set[str] = set()
    for snap in snapshots:
        seen.add(snap.host)
        track, evs = _fold_host(hosts.get(snap.host), snap, unreachable_alert_s)
        hosts[snap.host] = track
        events.extend(evs)
    for host, track in hosts.items():
        if host not in seen:
            track, evs = _check_unreachable(host, track, now, unreachable_alert_s)
            hosts[host] = track
            events.extend(evs)
    return WatchState(hosts=hosts), events


def _check_unreachable(
    host: str, track: HostTrack, now: float, alert_s: float
) -> tuple[HostTrack, list[WatchEvent]]:
    since = track.unreachable_since
    if since is None or track.unreachable_alerted or now - since < alert_s:
        return track, []
    event = WatchEvent(
        host,
        EventKind.UNREACHABLE,
        now,
        f"unreachable since {_clock(since)} ({_dur(now - since)})",
        since=since,
        step=track.step,
    )
    return replace(track, unreachable_alerted=True), [event]


def _fold_host(
    track: HostTrack | None, snap: HostSnapshot, alert_s: float
) -> tuple[HostTrack, list[WatchEvent]]:
    first = track is None
    t = track or HostTrack()
    host, at = snap.host, snap.at
    if not snap.reachable:
        if t.unreachable_since is None:
            t = replace(t, unreachable_since=at)
        return _check_unreachable(host, t, at, alert_s)

    events: list[WatchEvent] = []
    if t.unreachable_since is not None:
        if t.unreachable_alerted:
            events.append(
                WatchEvent(
                    host,
                    EventKind.RECOVERED,
                    at,
                    f"reachable again after {_dur(at - t.unreachable_since)}",
                    since=t.unreachable_since,
                    step=snap.step,
                )
            )
        t = replace(t, unreachable_since=None, unreachable_alerted=False)

    cond = snap.condition or Condition.STOPPED
    n = len(snap.restarts)
    if first or n < t.restarts_seen:
        restarts_seen = n  # history, or a fresh run's shorter list: a baseline, not news
    else:
        for r in snap.restarts[t.restarts_seen :]:
            events.append(
                WatchEvent(
                    host, EventKind.RESTARTED, r.at or at, _restart_text(r), step=r.resumed_step
                )
            )
        restarts_seen = n

    if snap.low_disk and not t.low_disk:
        events.append(WatchEvent(host, EventKind.LOW_DISK, at, snap.low_disk, step=snap.step))
    elif t.low_disk and not snap.low_disk:
        events.append(WatchEvent(host, EventKind.RECOVERED, at, "low disk cleared", step=snap.step))

    failed = snap.checkpoint_failed
    if failed is not None and failed != t.checkpoint_failed:
        text = snap.checkpoint_failure or f"checkpoint step {failed} not written"
        events.append(WatchEvent(host, EventKind.CHECKPOINT_FAILED, at, text, step=snap.step))
    elif failed is None and t.checkpoint_failed is not None:
        events.append(
            WatchEvent(host, EventKind.RECOVERED, at, "checkpoints written again", step=snap.step)
        )

    events.extend(_regen_events(host, at, t.regen, snap.regen, first))

    open_alert = t.open_alert
    if cond != t.condition or first:
        if cond in ALERT_CONDITIONS:
            if cond != open_alert:
                events.append(
                    WatchEvent(
                        host, _EVENT_OF[cond], at, _cond_text(cond, snap), cond, step=snap.step
                    )
                )
            open_alert = cond
        elif cond == Condition.FINISHED:
            if not first:
                events.append(
                    WatchEvent(
                        host, EventKind.FINISHED, at, _cond_text(cond, snap), cond, step=snap.step
                    )
                )
            open_alert = None
        elif cond in _CLEARING and open_alert is not None:
            events.append(
                WatchEvent(
                    host,
                    EventKind.RECOVERED,
                    at,
                    f"{open_alert.value} cleared: now {cond.value}",
                    open_alert,
                    step=snap.step,
                )
            )
            open_alert = None
    new = replace(
        t,
        condition=cond,
        open_alert=open_alert,
        restarts_seen=restarts_seen,
        step=snap.step,
        low_disk=snap.low_disk is not None,
        checkpoint_failed=failed,
        regen=snap.regen[:2] if snap.regen else t.regen,
    )
    return new, events


REGEN_ENDED = {"finished": EventKind.REGEN_FINISHED, "gave-up": EventKind.REGEN_FAILED}
REGEN_ENDED |= {"failed": EventKind.REGEN_FAILED, "lost": EventKind.REGEN_FAILED}


def _regen_events(
    host: str,
    at: float,
    seen: tuple[str, str] | None,
    now: tuple[str, str, str] | None,
    first: bool,
) -> list[WatchEvent]:
    """A job's end, once: seen live before (or started and ended between two polls)."""
    if now is None or first:
        return []
    job, state, detail = now
    kind = REGEN_ENDED.get(state)
    if kind is None or seen == (job, state):
        return []
    if seen is not None and seen[0] == job and seen[1] in REGEN_ENDED:
        return []  # already reported (its state text changed, e.g. gave-up read as failed)
    text = f"regeneration job {job} {state}" + (f": {detail}" if detail else "")
    return [WatchEvent(host, kind, at, text)]


def _restart_text(r: Restart) -> str:
    text = r.reason
    if r.resumed_step is not None:
        text += f" (resumed from step {r.resumed_step})"
    elif r.checkpoint_step is not None:
        text += f" (newest checkpoint: step {r.checkpoint_step})"
    return text


def _cond_text(cond: Condition, snap: HostSnapshot) -> str:
    parts: list[str] = []
    if cond == Condition.CRASHED and snap.exit_status is not None:
        parts.append(f"exit {snap.exit_status}")
    if snap.step is not None:
        parts.append(f"at step {snap.step}")
    if snap.detail:
        parts.append(snap.detail)
    return ", ".join(parts)


def _clock(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _dur(s: float) -> str:
    s = max(0, int(s))
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60} min"


def format_event_line(ev: WatchEvent) -> str:
    """One line for the watch's stdout: `2026-12-01T03:12:09Z gpu-a crashed: exit 1, at step 1200`."""
    text = f"{_clock(ev.at)} {ev.host} {ev.kind.value}"
    if ev.kind == EventKind.RECOVERED and ev.condition is None and ev.since is not None:
        text += " (unreachable)"
    return f"{text}: {ev.detail}" if ev.detail else text


# --- the bridge from `dflashctl status --json` ----------------------------------------------


def snapshot_from_status(d: Mapping[str, Any], at: float) -> HostSnapshot:
    """A HostSnapshot from one host's `status --json` dict (`RunStatus.to_json_dict()`).

    Reads only the documented JSON keys and tolerates missing ones, so the issue-12 additions
    (`restarts`, `supervisor.gave_up`, states `restarting`/`stalled`/`gave-up`) are used when
    present and older hosts still map (crashed / stopped / finished / running).
    """
    host = str(d.get("host", "?"))
    state = str(d.get("state", ""))
    step = d.get("step") if isinstance(d.get("step"), int) else None
    if state == "unreachable":
        return HostSnapshot(host, at, reachable=False, step=step, detail=_str(d.get("message")))
    exit_status = d.get("exit_status") if isinstance(d.get("exit_status"), int) else None
    raw_supervisor = d.get("supervisor")
    supervisor: Mapping[str, Any] = raw_supervisor if isinstance(raw_supervisor, Mapping) else {}
    # The supervisor is the pane's process: the pane says "running" while the trainer under it
    # is in a restart backoff or being killed for a stall, so its own state wins there.
    sup_state = _str(supervisor.get("state"))
    last_error = _str(d.get("last_error"))
    if supervisor.get("gave_up") or "gave-up" in (state, sup_state):
        cond = Condition.GAVE_UP
    elif last_error and NONFINITE_MARK in last_error and state in {"crashed", "stopped"}:
        cond = Condition.NONFINITE
    elif state in {"stalled", "restarting"}:
        cond = Condition(state)
    elif state == "running" and sup_state in {"stalled", "restarting"}:
        cond = Condition(sup_state)
    elif state in {"crashed", "running"}:
        cond = Condition(state)
    elif d.get("finished"):
        cond = Condition.FINISHED
    else:
        cond = Condition.STOPPED
    raw_restarts = d.get("restarts") or supervisor.get("restarts")
    if not isinstance(raw_restarts, list | tuple):
        raw_restarts = ()
    restarts = tuple(_restart(r) for r in raw_restarts if isinstance(r, Mapping))
    detail = last_error if cond in ALERT_CONDITIONS else None
    sup_detail = _str(supervisor.get("detail"))
    if cond in (Condition.GAVE_UP, Condition.STALLED) and sup_detail:
        # the supervisor's own account ("gave up after 2 restarts in 14 s: exit 1, exit 1, ...",
        # "no progress for 12 s (limit 10 s)") first: the trainer's last error is one attempt's
        detail = sup_detail + (f"; last error: {last_error}" if last_error else "")
    low = supervisor.get("low_disk")
    low_disk = _low_disk_text(low) if isinstance(low, Mapping) else None
    ck = d.get("checkpoint_failed")
    failed_step = _int(ck.get("step")) if isinstance(ck, Mapping) else None
    failure = (
        f"checkpoint step {failed_step} not written to {ck.get('directory', '?')}: "
        f"{ck.get('reason', '?')}"
        if isinstance(ck, Mapping) and failed_step is not None
        else None
    )
    return HostSnapshot(
        host,
        at,
        True,
        cond,
        exit_status,
        step,
        detail,
        restarts,
        low_disk,
        failed_step,
        failure,
        _regen_of(d.get("regen")),
    )


def _regen_of(raw: object) -> tuple[str, str, str] | None:
    """(id, state, detail) of status --json `regen`: the rows done, and why it ended badly."""
    if not isinstance(raw, Mapping) or not isinstance(raw.get("id"), str):
        return None
    state = str(raw.get("state", "?"))
    done, total = raw.get("rows_done"), raw.get("rows_total")
    parts = [f"{done}/{total} rows"] if isinstance(done, int) and isinstance(total, int) else []
    if isinstance(raw.get("errors"), int) and raw["errors"]:
        parts.append(f"{raw['errors']} in the errors file")
    if state != "finished":
        why = _str(raw.get("supervisor_detail")) or _str(raw.get("error"))
        parts += [why] if why else []
    elif _str(raw.get("out")):
        parts.append(f"OUT {raw['out']}")
    return str(raw["id"]), state, "; ".join(parts)


def _restart(r: Mapping[str, Any]) -> Restart:
    return Restart(
        at=_when(r.get("at")),
        reason=str(r.get("reason", "?")),
        exit_status=_int(r.get("exit_status")),
        resumed_step=_int(r.get("resumed_step")),
        checkpoint_step=_int(r.get("checkpoint_step")),
    )


def _int(v: object) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _when(v: object) -> float | None:
    """Epoch seconds from a number or an ISO-8601 UTC stamp (supervisor.json's `at`)."""
    if isinstance(v, int | float) and not isinstance(v, bool):
        return float(v)
    if isinstance(v, str):
        try:
            when = datetime.fromisoformat(v.replace("Z", "+00:00"))
            return (when if when.tzinfo else when.replace(tzinfo=UTC)).timestamp()
        except (ValueError, OverflowError, OSError):
            return None
    return None


def _str(v: object) -> str | None:
    return v if isinstance(v, str) and v else None


def _low_disk_text(low: Mapping[str, Any]) -> str:
    """The supervisor's own words (`0.5 MiB free on /data/ckpt, checkpoints need 3.0 MiB: ...;
    the next checkpoint will fail`); an older supervisor's entry (figures only): `0.5 MiB free
    on the run directory, checkpoint needs 1.0`."""
    text, consequence = low.get("text"), low.get("consequence")
    if isinstance(text, str) and isinstance(consequence, str):
        return f"{text}; {consequence}"
    free, need = low.get("free_mib", "?"), low.get("needed_mib", "?")
    where = low.get("path") if isinstance(low.get("path"), str) else "the run directory"
    return f"{free} MiB free on {where}, checkpoint needs {need}"
