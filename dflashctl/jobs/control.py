"""`JobControl`: start, follow, read and stop one host's detached job of one kind (`dflashctl
eval`, `dflashctl gate`) through a Transport, as `dflashctl measure` does its measure.

A job runs the deployed release (`releases/<id>`, resolved from `current` as start does, so a
deploy meanwhile swaps no code under it) in a tmux session of its own. It is refused while a
training run is live on the host, while a measure or another job runs there: each uses the
devices, and an engine reserves most of a GPU's memory.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from dflashctl.config.inventory import HostConfig
from dflashctl.jobs.state import JobBusy, JobError, JobState, parse_job_status
from dflashctl.remote.files import read_file, write_file_atomic
from dflashctl.remote.jobs import (
    EVAL,
    GATE,
    JobKind,
    cancel_argv,
    prepare_argv,
    run_argv,
    status_argv,
)
from dflashctl.remote.layout import MEASURE_ID_PATTERN, RemoteLayout
from dflashctl.remote.tmux import tmux_interrupt, tmux_kill_session, tmux_new_session
from dflashctl.remote.transport import (
    CommandResult,
    HostKeyError,
    HostUnreachable,
    Transport,
    TransportError,
)
from dflashctl.runs.control import RunControl
from dflashctl.runs.follow import Backoff
from dflashctl.runs.service import LIVE_STATES
from trainer.events import sanitize_for_terminal

KINDS = (EVAL, GATE)
DETACH_GRACE_S = 5.0
"""`--detach` waits this long for a job that is refused at once (a bad flag or file)."""
FOLLOW_POLL_S = 30.0
"""One follow round trip waits up to this long on the host for an output line or the end."""
STOP_GRACE_S = 30.0
"""`--stop` waits this long for the job to end on Ctrl-C before it kills the session."""
ROUND_TRIP_MARGIN_S = 30.0
"""A remote wait of T seconds is given T + this before the client gives up on it."""

CommandFor = Callable[[str], list[str]]
"""The job's argv, given its id (its paths name the job's directory)."""


@dataclass(frozen=True)
class JobStarted:
    host: str
    kind: JobKind
    job_id: str
    release: str
    session: str
    argv: list[str]
    directory: str


class JobControl:
    """One host's jobs of one kind, over a Transport (SSH+pct or local)."""

    def __init__(self, transport: Transport, host: HostConfig, kind: JobKind) -> None:
        self.transport = transport
        self.host = host
        self.kind = kind
        self.layout = RemoteLayout(host.workdir)
        self.session = kind.session(host.session)

    async def _run(
        self, argv: list[str], *, timeout: float | None = None, input: bytes | None = None
    ) -> CommandResult:
        return await self.transport.run(argv, timeout=timeout, input=input)

    def job_dir(self, job_id: str) -> str:
        return self.layout.path(self.kind.dir(job_id))

    async def state(
        self, from_line: int = 0, wait_s: float = 0.0, job_id: str | None = None
    ) -> JobState:
        """The newest job (or `job_id`), after waiting on the host up to `wait_s` for its output
        line past 0-based `from_line` or its end. HostUnreachable when the host cannot be asked."""
        argv = status_argv(
            self.host.workdir, self.kind, self.host.session, from_line, wait_s, job_id
        )
        res = await self._run(argv, timeout=wait_s + ROUND_TRIP_MARGIN_S)
        if not res.ok:
            msg = res.error_line()
            if "not running" in msg:
                msg = f"container {self.host.ctid} is not running (pct start {self.host.ctid})"
            raise HostUnreachable(sanitize_for_terminal(f"{self.host.name}: {msg}"))
        return parse_job_status(self.host.name, self.kind, self.host.workdir, res.stdout)

    async def check_free(self) -> JobState:
        """This kind's newest job, once nothing else would share the devices (`check_free`)."""
        return await check_free(self.transport, self.host, self.kind)

    async def start(
        self,
        command_for: CommandFor,
        info: Callable[[], Mapping[str, object]],
        files: Mapping[str, bytes] | None = None,
        ready: Callable[[], Awaitable[None]] | None = None,
    ) -> JobStarted:
        """Start a job in its own tmux session: `command_for(id)` is its argv, `info()` goes
        to its info.json, `files` (relative name -> bytes) are written into its directory
        first. Refused (JobBusy) while anything else uses the devices, and for a host with
        nothing deployed or a release that cannot run this kind; then `ready()` checks (and
        resolves) what the job needs there, before anything is written."""
        name = self.host.name
        st = await self.check_free()
        if st.release is None:
            raise JobError(f"{name}: nothing deployed; run `dflashctl deploy {name}`")
        if not st.runnable:
            raise JobError(
                f"{name}: release {st.release} has no {self.kind.source} (deployed before "
                f"`dflashctl {self.kind.name}` existed); deploy a newer tree"
            )
        if ready is not None:
            await ready()
        record = {**info(), "release": st.release, "session": self.session}
        prep = await self._run(
            prepare_argv(self.host.workdir, self.kind), input=json.dumps(record).encode()
        )
        jid = prep.stdout.strip().splitlines()[-1] if prep.ok and prep.stdout.strip() else ""
        if not prep.ok or not re.match(MEASURE_ID_PATTERN, jid):
            raise JobError(f"{name}: preparing the {self.kind.name} directory: {prep.error_line()}")
        d = self.job_dir(jid)
        for rel, data in (files or {}).items():
            res = await self._run(write_file_atomic(f"{d}/{rel}"), input=data)
            if not res.ok:
                await self._run(["rm", "-rf", "--", d])
                raise JobError(f"{name}: writing {d}/{rel}: {res.error_line()}")
        argv = command_for(jid)
        if st.pane is not None:  # the last job's dead pane (remain-on-exit): cleared
            await self._run(tmux_kill_session(self.session))
        env = {
            **self.host.env,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": self.layout.release_dir(st.release),
            "DFLASH_RELEASE": st.release,
        }
        command = tmux_new_session(
            self.session,
            run_argv(self.host.workdir, self.kind, jid, argv),
            cwd=self.host.workdir,
            env=env,
        )
        res = await self._run(command)
        for attempt in range(4):  # a tmux server exiting as its last session ended: retried
            if res.ok or "server exited unexpectedly" not in res.stderr:
                break
            await asyncio.sleep(0.1 * (attempt + 1))
            res = await self._run(command)
        if not res.ok:
            await self._run(["rm", "-rf", "--", d])
            if "duplicate session" in res.stderr:
                raise JobBusy(
                    f"{name}: another {self.kind.name} started meanwhile (tmux session "
                    f"{self.session!r})"
                )
            raise JobError(f"{name}: tmux new-session: {res.error_line()}")
        return JobStarted(name, self.kind, jid, st.release, self.session, argv, d)

    async def follow(
        self,
        on_line: Callable[[str], None],
        on_note: Callable[[str], None],
        *,
        job_id: str | None = None,
        from_line: int = 0,
        poll_s: float = FOLLOW_POLL_S,
        backoff: Backoff | None = None,
    ) -> JobState:
        """Wait for the newest job (or `job_id`) to end, passing each new output line to
        `on_line`; a dropped link is retried (the job goes on: it lives in tmux), each drop and
        reconnect one `on_note`. Returns its last state with all of its output lines."""
        delays = backoff or Backoff(jitter=0.2)
        lines: list[str] = []
        attempt, lost = 0, False
        while True:
            try:
                st = await self.state(from_line + len(lines), poll_s, job_id)
            except HostKeyError:
                raise
            except TransportError as err:
                wait = delays.delay(attempt)
                attempt += 1
                lost = True
                on_note(
                    f"lost the link ({err}); the {self.kind.name} goes on there; retrying in "
                    f"{wait:.0f} s"
                )
                await asyncio.sleep(wait)
                continue
            if lost:
                on_note("reconnected")
            attempt, lost = 0, False
            for line in st.output:
                lines.append(line)
                on_line(line)
            if not st.running:
                return replace(st, output=lines)

    async def read_json(self, st: JobState, name: str) -> dict[str, object]:
        """A JSON object the job wrote into its directory (`result.json`, `summary.json`)."""
        path = f"{st.directory}/{name}"
        res = await self._run(read_file(path))
        if not res.ok:
            raise JobError(f"{self.host.name}: {st.name}: {res.error_line()}")
        try:
            data = json.loads(res.stdout)
        except json.JSONDecodeError as err:
            raise JobError(f"{self.host.name}: {path} is not JSON: {err}") from None
        if not isinstance(data, dict):
            raise JobError(f"{self.host.name}: {path} is not a JSON object")
        return data

    async def stop(self, grace_s: float = STOP_GRACE_S) -> JobState | None:
        """End the running job, recording that it was stopped: Ctrl-C first (trainer.eval and
        trainer.gate stop an engine they started on the way out; the engine runs in a session
        of its own, which killing the pane would orphan), its session killed after `grace_s`.
        None when none was running."""
        st = await self.state()
        if not st.running or st.job_id is None:
            return None
        await self._run(cancel_argv(self.host.workdir, self.kind, st.job_id))
        await self._run(tmux_interrupt(self.session))
        after = await self.state(len(st.output) + 1_000_000, grace_s, st.job_id)
        if after.running:
            res = await self._run(tmux_kill_session(self.session))
            if not res.ok and "can't find session" not in res.stderr:
                raise JobError(f"{self.host.name}: tmux kill-session: {res.error_line()}")
        return st


async def check_free(transport: Transport, host: HostConfig, kind: JobKind) -> JobState:
    """This kind's newest job, once nothing else would share the devices: JobBusy while a
    training run is live, a measure runs, or a job of any kind runs on the host."""
    name = host.name
    run = await RunControl(transport, host).reader.status_for(kind.name)
    if run.state in LIVE_STATES:
        step = f", step {run.step}" if run.step is not None else ""
        raise JobBusy(
            f"{name}: a training run is {run.state} in tmux session {host.session!r} "
            f"(release {run.run_release or '?'}{step}): {kind.name} would share its "
            f"devices; `dflashctl stop {name}` first"
        )
    if run.measure is not None:
        raise JobBusy(
            f"{name}: measure {run.measure.id} is running there (since {run.measure.since}): "
            f"{kind.name} would share its devices; `dflashctl measure {name} --stop` "
            "ends it"
        )
    mine: JobState | None = None
    for each in KINDS:
        other = JobControl(transport, host, each)
        st = await other.state()
        if st.running:
            raise JobBusy(
                f"{name}: {st.name} is already running ({st.since()}, tmux session "
                f"{other.session!r}): `dflashctl {each.name} {name} --result` shows how far "
                f"it is, `--stop` ends it"
            )
        if each == kind:
            mine = st
    assert mine is not None
    return mine


def output_tail(lines: Sequence[str], count: int = 3) -> str:
    """The last `count` non-blank output lines, `; `-joined (how far a running job is)."""
    shown = [ln.strip() for ln in lines if ln.strip()][-count:]
    return "; ".join(shown) if shown else "no output yet"
