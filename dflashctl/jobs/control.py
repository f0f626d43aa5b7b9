"""`JobControl`: start, follow, read and stop one host's detached job of one kind (`dflashctl
eval`, `dflashctl gate`) through a Transport, as `dflashctl measure` does its measure.

A job runs the deployed release (`releases/<id>`, resolved from `current` as start does, so a
deploy meanwhile swaps no code under it) in a tmux session of its own. It is refused while a
training run is live on the host, while a measure or another job runs there: each uses the
devices, and an engine reserves most of a GPU's memory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from dflashctl.config.inventory import HostConfig
from dflashctl.jobs.state import JobBusy, JobError, JobState, parse_job_status
from dflashctl.remote.files import write_file_atomic
from dflashctl.remote.jobs import (
    EVAL,
    GATE,
    JobKind,
    cancel_argv,
    prepare_argv,
    run_argv,
    status_argv,
)
from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.tmux import tmux_interrupt, tmux_kill_session, tmux_new_session
from dflashctl.remote.transport import Transport
from dflashctl.runs.control import RunControl
from dflashctl.runs.detached import DetachedControl, not_runnable, training_busy
from dflashctl.runs.follow import Backoff

KINDS = (EVAL, GATE)
DETACH_GRACE_S = 5.0
"""`--detach` waits this long for a job that is refused at once (a bad flag or file)."""
FOLLOW_POLL_S = 30.0
"""One follow round trip waits up to this long on the host for an output line or the end."""
STOP_GRACE_S = 30.0
"""`--stop` waits this long for the job to end on Ctrl-C before it kills the session."""

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


class JobControl(DetachedControl):
    """One host's jobs of one kind, over a Transport (SSH+pct or local)."""

    error = JobError

    def __init__(self, transport: Transport, host: HostConfig, kind: JobKind) -> None:
        super().__init__(transport, host, kind.session(host.session))
        self.kind = kind
        self.layout = RemoteLayout(host.workdir)

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
        stdout = await self._status(argv, wait_s)
        return parse_job_status(self.host.name, self.kind, self.host.workdir, stdout)

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
        before = f"`dflashctl {self.kind.name}`"
        problem = not_runnable(name, st.release, st.runnable, self.kind.source, before)
        if problem or st.release is None:
            raise JobError(problem)
        if ready is not None:
            await ready()
        record = {**info(), "release": st.release, "session": self.session}
        jid = await self._prepare(
            prepare_argv(self.host.workdir, self.kind), record, f"{self.kind.name} directory"
        )
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
        await self._launch(command, d, self.kind.name, JobBusy)
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

        async def fetch(seen: int) -> JobState:
            return await self.state(from_line + seen, poll_s, job_id)

        what = f"the {self.kind.name}"
        st, lines = await self._follow(fetch, lambda s: s.output, on_line, on_note, what, backoff)
        return replace(st, output=lines)

    async def read_json(self, st: JobState, name: str) -> dict[str, object]:
        """A JSON object the job wrote into its directory (`result.json`, `summary.json`)."""
        return await self._read_json_object(
            f"{st.directory}/{name}", f"{self.host.name}: {st.name}"
        )

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
            await self._kill_session()
        return st


async def check_free(transport: Transport, host: HostConfig, kind: JobKind) -> JobState:
    """This kind's newest job, once nothing else would share the devices: JobBusy while a
    training run is live, a measure runs, or a job of any kind runs on the host."""
    name = host.name
    run = await RunControl(transport, host).reader.status_for(kind.name)
    busy = training_busy(host, run, kind.name)
    if busy is not None:
        raise JobBusy(busy)
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
