"""A regeneration job as status shows it (`RegenJob`), parsed from a status report. Pure.

Both reports carry the same sections, the run status script's with a `regen_` prefix
(`dflashctl.remote.run.STATUS_SCRIPT`: the newest job, for status, the TUI and watch) and the
job's own without (`dflashctl.remote.regen.REGEN_STATUS_SCRIPT`): the job window's and the
engine window's pane states, the exit status the wrapper published, whether a stop was asked,
its info.json and supervisor.json, and the tail of its status.log (trainer.regen's `Regen:`
lines, its phase and error lines, the supervisor's).

States: `running` (its window alive), `restarting` (the supervisor's backoff), `finished`
(exit 0), `stopped` (a stop was asked), `gave-up` (the supervisor gave up), `failed` (another
exit status), `lost` (no exit status and no live window: the container restarted).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from dflashctl.remote.layout import MEASURE_ID_FORMAT, MEASURE_ID_PATTERN
from dflashctl.remote.tmux import PaneState, parse_pane_state
from trainer.events import (
    ErrorEvent,
    PhaseEvent,
    RegenEvent,
    format_eta,
    parse_text,
    sanitize_for_terminal,
)
from trainer.events.run_state import read_json_object

LIVE = frozenset({"running", "restarting"})
ENDED = frozenset({"finished", "stopped", "gave-up", "failed", "lost"})


@dataclass(frozen=True)
class RegenJob:
    """The newest regeneration job on a host (None in status when none ever ran there)."""

    id: str
    state: str
    since: str  # its start, `2026-12-01 17:02:11 UTC`
    age_s: float | None = None  # by the host's clock
    exit_status: int | None = None
    last: RegenEvent | None = None  # its newest `Regen:` status line
    error: str | None = None  # its newest ERROR line (the job's or the health wait's)
    finished: str | None = None  # its `Regen finished:` summary
    server_note: str | None = None  # its newest server state change (down, up again)
    restarts: int = 0
    supervisor_detail: str | None = None  # "gave up after ..." and the like
    engine: str | None = None  # --serve: "running" | "exited (status N)"; None: no engine
    out: str | None = None
    servers: list[str] = field(default_factory=list)
    log_lines: int = 0  # lines of its status.log (a follow's position)

    @property
    def live(self) -> bool:
        return self.state in LIVE

    def progress(self) -> float | None:
        """Share of the rows that ended (None before the first status line)."""
        ev = self.last
        return ev.finished / ev.total if ev is not None and ev.total else None

    def length_share(self) -> float | None:
        ev = self.last
        return ev.length / ev.finished if ev is not None and ev.finished else None

    def to_json_dict(self) -> dict[str, Any]:
        ev = self.last
        return {
            "id": self.id,
            "state": self.state,
            "since": self.since,
            "age_s": self.age_s,
            "exit_status": self.exit_status,
            "rows_done": ev.finished if ev else None,
            "rows_total": ev.total if ev else None,
            "progress": self.progress(),
            "rows_s": ev.rows_s if ev else None,
            "gen_tok_s": ev.gen_tok_s if ev else None,
            "prompt_tok_s": ev.prompt_tok_s if ev else None,
            "eta_s": ev.eta_s if ev else None,
            "errors": ev.errors if ev else None,
            "length_capped": ev.length if ev else None,
            "length_share": self.length_share(),
            "in_flight": list(ev.in_flight) if ev else [],
            "servers_down": ev.extra_int("down") if ev else None,
            "retries": ev.extra_int("retries") if ev else None,
            "last_line": ev.model_dump() if ev else None,
            "error": self.error,
            "finished": self.finished,
            "server_note": self.server_note,
            "restarts": self.restarts,
            "supervisor_detail": self.supervisor_detail,
            "engine": self.engine,
            "out": self.out,
            "servers": list(self.servers),
        }


def _state(
    pane: PaneState | None, exit_status: int | None, cancelled: bool, sup: dict[str, Any]
) -> str:
    if exit_status is not None:
        if exit_status == 0:
            return "finished"
        if cancelled:
            return "stopped"
        return "gave-up" if sup.get("gave_up") else "failed"
    if pane is not None and not pane.dead:
        return "restarting" if sup.get("state") in ("restarting", "stalled") else "running"
    return "stopped" if cancelled else "lost"


def _engine(pane: PaneState | None) -> str | None:
    if pane is None:
        return None
    return "running" if not pane.dead else f"exited (status {pane.exit_status})"


def parse_regen_job(sections: dict[str, str], prefix: str = "") -> RegenJob | None:
    """The job in a report's sections (`prefix`: "regen_" in the run status report); None when
    the report names no job."""
    s = {k: sanitize_for_terminal(v) for k, v in sections.items()}
    jid = s.get("regen" if prefix else "id", "").strip()
    if not re.match(MEASURE_ID_PATTERN, jid):
        return None
    started = datetime.strptime(jid, MEASURE_ID_FORMAT).replace(tzinfo=UTC).timestamp()

    def get(name: str) -> str:
        return s.get(prefix + name, "")

    pane = parse_pane_state(get("pane"))
    exit_text = get("exit").strip()
    exit_status = int(exit_text) if re.fullmatch(r"-?\d+", exit_text) else None
    sup, _ = read_json_object(get("supervisor"), "supervisor.json")
    sup = sup or {}
    info, _ = read_json_object(get("info"), "info.json")
    info = info or {}
    events = parse_text(get("log"))
    last = next((e for e in reversed(events) if isinstance(e, RegenEvent)), None)
    errors = [e.message for e in events if isinstance(e, ErrorEvent)]
    phases = [e for e in events if isinstance(e, PhaseEvent)]
    done = [p.detail for p in phases if p.phase == "regen_finished"]
    notes = [p.detail for p in phases if p.phase == "regen_server"]
    restarts = sup.get("restarts")
    detail = sup.get("detail")
    now = get("now").strip() or s.get("now", "").strip()
    lines = get("log_lines").strip()
    servers = info.get("servers")
    return RegenJob(
        id=jid,
        state=_state(pane, exit_status, bool(get("cancelled").strip()), sup),
        since=datetime.fromtimestamp(started, UTC).strftime("%Y-%m-%d %H:%M:%S UTC"),
        age_s=max(0.0, int(now) - started) if now.isdigit() else None,
        exit_status=exit_status,
        last=last,
        error=errors[-1] if errors else None,
        finished=done[-1] if done else None,
        server_note=notes[-1] if notes else None,
        restarts=len(restarts) if isinstance(restarts, list) else 0,
        supervisor_detail=detail if isinstance(detail, str) else None,
        engine=_engine(parse_pane_state(get("engine"))),
        out=str(info["out"]) if isinstance(info.get("out"), str) else None,
        servers=[str(u) for u in servers] if isinstance(servers, list) else [],
        log_lines=int(lines) if lines.isdigit() else 0,
    )


def regen_line(host: str, job: RegenJob) -> str:
    """`dflashctl status`'s line (and the TUI's) for a host's newest regeneration job."""
    ev = job.last
    if ev is None:
        what = "no status line yet"
    else:
        share = job.length_share()
        what = (
            f"{ev.finished:,}/{ev.total:,} rows ({(job.progress() or 0):.0%}), "
            f"{_rate(ev.rows_s, 'rows/s', 2)}, {_rate(ev.gen_tok_s, 'gen tok/s', 0)}, "
            f"ETA {_eta(ev.eta_s)}, errors {ev.errors}, length-capped {ev.length}"
            + (f" ({share:.1%})" if share is not None else "")
            + f", in flight {json.dumps(ev.in_flight)}"
            + (f", {ev.extra_int('down')} server(s) down" if ev.extra_int("down") else "")
        )
    tail = ""
    if job.state in ("failed", "gave-up", "lost") and (job.supervisor_detail or job.error):
        tail = f"; {job.supervisor_detail or job.error}"
    engine = f"; engine {job.engine}" if job.engine else ""
    return f"  regen: {job.id} {job.state} (since {job.since}): {what}{engine}{tail}"


def _rate(value: float | None, unit: str, digits: int) -> str:
    return f"--- {unit}" if value is None else f"{value:,.{digits}f} {unit}"


def _eta(seconds: float | None) -> str:
    return format_eta(seconds)
