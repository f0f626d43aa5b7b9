"""What a detached job (`dflashctl measure`, and `eval`/`gate` in `dflashctl.jobs`) shares: a
remote command in a tmux session of its own, under `WORKDIR/<kind>/<id>/` (<id> = its UTC start,
`20261201T170211Z`), with `exit-status` written once it has exited.

`parse_status` reads the sections its status script prints (the id, the state, the host's clock,
`info.json`, what `current` points at); `DetachedRecord` is the record's times and directory;
`outcome_error` is the error one that ended without a result is; `DetachedControl` starts,
follows, reads and stops one over a Transport."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import DflashctlError
from dflashctl.humanize import format_age
from dflashctl.remote.files import read_file
from dflashctl.remote.layout import MEASURE_ID_PATTERN
from dflashctl.remote.tmux import PaneState, parse_pane_state, tmux_kill_session
from dflashctl.remote.transport import (
    CommandResult,
    HostKeyError,
    HostUnreachable,
    Transport,
    TransportError,
)
from dflashctl.runs.follow import Backoff
from dflashctl.runs.service import LIVE_STATES
from dflashctl.runs.snapshot import RunStatus, iso_utc, measure_started, split_sections
from trainer.events import sanitize_for_terminal

ROUND_TRIP_MARGIN_S = 30.0
"""A remote wait of T seconds is given T + this before the client gives up on it."""

E = TypeVar("E", bound=DflashctlError)


# --- the record ------------------------------------------------------------------------------


class DetachedRecord:
    """A detached job's state, times and directory, for a frozen dataclass that has `state`,
    `now` (the host's clock) and `workdir`, and names its id and directory."""

    state: str
    now: float | None
    workdir: str
    exit_status: int | None
    cancelled_at: str | None

    @property
    def record_id(self) -> str | None:
        raise NotImplementedError

    def subdir(self, record_id: str) -> str:
        """Its directory relative to the workdir."""
        raise NotImplementedError

    @property
    def running(self) -> bool:
        return self.state == "running"

    @property
    def started(self) -> float | None:
        rid = self.record_id
        return measure_started(rid) if rid else None

    def age(self) -> float | None:
        """Seconds since it started, by the host's clock."""
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
        return f"{self.workdir}/{self.subdir(self.record_id or '?')}"


@dataclass(frozen=True)
class StatusSections:
    """What every detached job's status script reports, parsed (`parse_status`); `sections`
    holds all of them, sanitised, for what is the kind's own."""

    sections: dict[str, str]
    record_id: str | None
    state: str
    exit_status: int | None
    now: float | None
    info: dict[str, Any]
    release: str | None
    pane: PaneState | None
    cancelled_at: str | None

    def lines(self, name: str) -> list[str]:
        """A section's lines (none when it is blank)."""
        text = self.sections.get(name, "")
        return text.splitlines() if text.strip() else []

    def flag(self, name: str) -> bool:
        """A section that says `yes`."""
        return self.sections.get(name, "").strip() == "yes"


def parse_status(stdout: str) -> StatusSections | None:
    """The status script's sections (pure; remote text sanitised here); None when the host has
    no workdir. The state: none (no id), finished / failed / cancelled (its exit status),
    running (no exit status, its pane alive), cancelled or lost (neither)."""
    raw = split_sections(stdout)
    if "noworkdir" in raw:
        return None
    s = {k: sanitize_for_terminal(v) for k, v in raw.items()}
    rid = s.get("id", "").strip()
    if not re.match(MEASURE_ID_PATTERN, rid):
        rid = ""
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
    if not rid:
        state = "none"
    elif exit_status is not None:
        state = "finished" if exit_status == 0 else "cancelled" if cancelled else "failed"
    elif pane is not None and not pane.dead:
        state = "running"
    else:
        state = "cancelled" if cancelled else "lost"
    now_text = s.get("now", "").strip()
    current = s.get("current", "").strip()
    return StatusSections(
        sections=s,
        record_id=rid or None,
        state=state,
        exit_status=exit_status,
        now=float(now_text) if now_text.isdigit() else None,
        info=info,
        release=current.rsplit("/", 1)[-1] if current else None,
        pane=pane,
        cancelled_at=cancelled,
    )


# --- what one that ended without a result is -------------------------------------------------


def error_line(
    output: Sequence[str], exit_status: int | None, said: tuple[str, ...] = ("error: ",)
) -> str:
    """What a job that did not finish said last: its last line starting with one of `said`
    (without an `error: ` prefix), else its last line, else its exit status."""
    lines = [ln.strip() for ln in output if ln.strip()]
    marked = [ln for ln in lines if ln.startswith(said)]
    if marked:
        return marked[-1].removeprefix("error: ")
    if lines:
        return lines[-1]
    return f"exit status {exit_status}" if exit_status is not None else "it printed nothing"


def outcome_error(
    st: DetachedRecord,
    output: Sequence[str],
    what: str,
    refused: str,
    errors: tuple[type[E], type[E]],
    said: tuple[str, ...] = ("error: ",),
) -> E | None:
    """The error a job that ended without a result is, from all of its `output` lines (None: it
    finished, or still runs): `what` names it (`HOST: measure ID`), `refused` prefixes its
    module's own refusal, exit 2 (`HOST: trainer.measure`); `errors`: (the kind's error, its
    refusal)."""
    error, refusal = errors
    exit_status, cancelled_at = st.exit_status, st.cancelled_at
    if st.state == "failed" and exit_status == 2:
        return refusal(f"{refused}: {error_line(output, 2, said)}")
    if st.state == "failed":
        how = "failed" if exit_status == 1 else f"exited with status {exit_status}"
        return error(f"{what} {how}: {error_line(output, exit_status, said)}")
    if st.state == "cancelled":
        return error(f"{what} was stopped ({cancelled_at}) before it finished")
    if st.state == "lost":
        return error(
            f"{what} ended without a result (no exit status, no live session: the container "
            f"restarted or the session was killed); last: {error_line(output, None, said)}"
        )
    return None


def not_runnable(name: str, release: str | None, runnable: bool, source: str, before: str) -> str:
    """Why the deployed `release` cannot run a job whose code is `source` (`before`: what it
    was deployed before, `trainer.measure`); "" when it can."""
    if release is None:
        return f"{name}: nothing deployed; run `dflashctl deploy {name}`"
    if not runnable:
        return (
            f"{name}: release {release} has no {source} (deployed before {before} existed); "
            f"deploy a newer tree"
        )
    return ""


def training_busy(host: HostConfig, run: RunStatus, what: str) -> str | None:
    """The refusal while a training run is live on the host (`what`: `a measure`, `gate`, which
    would share its devices); None when none is."""
    if run.state not in LIVE_STATES:
        return None
    step = f", step {run.step}" if run.step is not None else ""
    return (
        f"{host.name}: a training run is {run.state} in tmux session {host.session!r} "
        f"(release {run.run_release or '?'}{step}): {what} would share its devices; "
        f"`dflashctl stop {host.name}` first"
    )


class _Follows(Protocol):
    """What a follow polls: whether the job still runs."""

    @property
    def running(self) -> bool: ...


S = TypeVar("S", bound=_Follows)


# --- the service -----------------------------------------------------------------------------


class DetachedControl:
    """The remote plumbing one host's detached job of one kind shares, over a Transport: its
    status round trip, its tmux session started and killed, its output followed, a JSON file
    of its directory read. `error` is the kind's error class (one line, the host named)."""

    error: type[DflashctlError] = DflashctlError

    def __init__(self, transport: Transport, host: HostConfig, session: str) -> None:
        self.transport = transport
        self.host = host
        self.session = session

    async def _run(
        self, argv: list[str], *, timeout: float | None = None, input: bytes | None = None
    ) -> CommandResult:
        return await self.transport.run(argv, timeout=timeout, input=input)

    async def _status(self, argv: list[str], wait_s: float) -> str:
        """The status script's output (it waits on the host up to `wait_s`); HostUnreachable
        when the host cannot be asked."""
        res = await self._run(argv, timeout=wait_s + ROUND_TRIP_MARGIN_S)
        if not res.ok:
            msg = res.error_line()
            if "not running" in msg:
                msg = f"container {self.host.ctid} is not running (pct start {self.host.ctid})"
            raise HostUnreachable(sanitize_for_terminal(f"{self.host.name}: {msg}"))
        return res.stdout

    async def _prepare(self, argv: list[str], info: object, what: str) -> str:
        """A new job directory, `info` its info.json: the id the prepare script printed."""
        prep = await self._run(argv, input=json.dumps(info).encode())
        rid = prep.stdout.strip().splitlines()[-1] if prep.ok and prep.stdout.strip() else ""
        if not prep.ok or not re.match(MEASURE_ID_PATTERN, rid):
            raise self.error(f"{self.host.name}: preparing the {what}: {prep.error_line()}")
        return rid

    async def _new_session(self, command: list[str]) -> CommandResult:
        """`tmux new-session`, retried while a tmux server exits as its last session ended."""
        res = await self._run(command)
        for attempt in range(4):
            if res.ok or "server exited unexpectedly" not in res.stderr:
                break
            await asyncio.sleep(0.1 * (attempt + 1))
            res = await self._run(command)
        return res

    async def _launch(
        self, command: list[str], directory: str, what: str, busy: type[DflashctlError]
    ) -> None:
        """Start `command` (a `tmux new-session`); when it does not start, `directory` (the
        job's, just made) is removed and the error raised: `busy` when another `what` took the
        session meanwhile."""
        res = await self._new_session(command)
        if res.ok:
            return
        await self._run(["rm", "-rf", "--", directory])
        name = self.host.name
        if "duplicate session" in res.stderr:
            raise busy(f"{name}: another {what} started meanwhile (tmux session {self.session!r})")
        raise self.error(f"{name}: tmux new-session: {res.error_line()}")

    async def _kill_session(self) -> None:
        res = await self._run(tmux_kill_session(self.session))
        if not res.ok and "can't find session" not in res.stderr:
            raise self.error(f"{self.host.name}: tmux kill-session: {res.error_line()}")

    async def _follow(
        self,
        fetch: Callable[[int], Awaitable[S]],
        lines_of: Callable[[S], list[str]],
        on_line: Callable[[str], None],
        on_note: Callable[[str], None],
        what: str,
        backoff: Backoff | None,
    ) -> tuple[S, list[str]]:
        """`fetch(n)` (the state, with its lines past the first n) until it no longer runs,
        passing each new line to `on_line`; a dropped link is retried (the job goes on: it lives
        in tmux), each drop and reconnect one `on_note`. Its last state and all of its lines."""
        delays = backoff or Backoff(jitter=0.2)
        lines: list[str] = []
        attempt, lost = 0, False
        while True:
            try:
                st = await fetch(len(lines))
            except HostKeyError:
                raise
            except TransportError as err:
                wait = delays.delay(attempt)
                attempt += 1
                lost = True
                on_note(f"lost the link ({err}); {what} goes on there; retrying in {wait:.0f} s")
                await asyncio.sleep(wait)
                continue
            if lost:
                on_note("reconnected")
            attempt, lost = 0, False
            for line in lines_of(st):
                lines.append(line)
                on_line(line)
            if not st.running:
                return st, lines

    async def _read_json(self, path: str, unread: str) -> Any:
        """The JSON in `path` (`unread`: the error line's prefix when it cannot be read)."""
        res = await self._run(read_file(path))
        if not res.ok:
            raise self.error(f"{unread}: {res.error_line()}")
        try:
            return json.loads(res.stdout)
        except json.JSONDecodeError as err:
            raise self.error(f"{self.host.name}: {path} is not JSON: {err}") from None

    async def _read_json_object(self, path: str, unread: str) -> dict[str, Any]:
        """`_read_json`, refused unless it is a JSON object."""
        data = await self._read_json(path, unread)
        if not isinstance(data, dict):
            raise self.error(f"{self.host.name}: {path} is not a JSON object")
        return data
