"""`dflashctl regen HOST`: `python -m trainer.regen` in the host's container, supervised, detached.

The job runs the deployed release (`releases/<id>`, resolved from `current` as start does) in
a tmux session of its own (the host's session + `-regen`): window `job` runs the in-container
supervisor (`python -m trainer.supervise --child regen`, the host's restart policy: a failed
attempt is restarted with `--resume`) around trainer.regen; with `--serve CMD`, window `engine`
runs the serving engine first, the job waits for its /health, and the engine is stopped when
the job ends (refused while a training run is live there: the engine would share its
devices; `--server URL` of an engine elsewhere is not). Everything is under `WORKDIR/regen/<id>/` (`dflashctl.remote.layout`): status.log
(trainer.regen's lines: what status, the TUI and watch read), supervisor.json, engine.log,
health.log, info.json, exit-status. OUT and its errors file are where `--out` says (a
container path; a relative one is under the workdir).

Pure request checks first, then `RegenControl`, the service over a Transport (no Textual);
`dflashctl.cli.regen` only parses flags and prints.
"""

from __future__ import annotations

import asyncio
import shlex
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import DflashctlError, ExitCode, UsageError
from dflashctl.remote.layout import (
    REGEN_ENGINE_WINDOW,
    REGEN_JOB_WINDOW,
    REGEN_SOURCE,
    RemoteLayout,
    regen_dir,
    regen_session,
)
from dflashctl.remote.regen import (
    engine_window_command,
    regen_prepare_argv,
    regen_run_argv,
    regen_session_argv,
    regen_status_argv,
    regen_stop_argv,
)
from dflashctl.remote.tmux import tmux_kill_session
from dflashctl.remote.transport import Transport
from dflashctl.runs.control import RunControl
from dflashctl.runs.detached import DetachedControl
from dflashctl.runs.follow import Backoff
from dflashctl.runs.regen_view import RegenJob, parse_regen_job
from dflashctl.runs.service import LIVE_STATES
from dflashctl.runs.snapshot import split_sections
from trainer.events import sanitize_for_terminal

REGEN_MODULE = "trainer.regen"
SUPERVISOR_MODULE = "trainer.supervise"
DEFAULT_ENGINE_PORT = 8000  # vLLM's (`vllm serve` without --port)
ENGINE_WAIT_S = 1800.0
FOLLOW_POLL_S = 30.0
STOP_WAIT_S = 120.0


class RegenError(DflashctlError):
    """A regeneration job that failed, or cannot start now (one line, the host named)."""

    exit_code = ExitCode.FAILED


class RegenBusy(RegenError):
    """A regeneration job already runs on the host, or (--serve) a training run does."""


def engine_url(serve: list[str]) -> str:
    """The URL an engine started by `serve` answers on: 127.0.0.1 and its `--port` (vLLM's
    default 8000 without one)."""
    for i, word in enumerate(serve):
        value = serve[i + 1] if word == "--port" and i + 1 < len(serve) else None
        if word.startswith("--port="):
            value = word.split("=", 1)[1]
        if value is not None:
            if not value.isdigit() or not 0 < int(value) < 65536:
                raise UsageError(f"--serve: --port {value!r} is not a port")
            return f"http://127.0.0.1:{value}"
    return f"http://127.0.0.1:{DEFAULT_ENGINE_PORT}"


@dataclass(frozen=True)
class RegenRequest:
    """What `dflashctl regen` asks of trainer.regen (flags passed on as given)."""

    inputs: tuple[str, ...]
    out: str
    servers: tuple[str, ...] = ()
    serve: str | None = None
    serve_wait_s: float = ENGINE_WAIT_S
    flags: tuple[str, ...] = ()  # trainer.regen's other flags (--model, --reasoning, ...)
    resume: bool = False  # continue an OUT an earlier job left (trainer.regen --resume)

    def serve_argv(self) -> list[str] | None:
        if self.serve is None:
            return None
        try:
            words = shlex.split(self.serve)
        except ValueError as err:
            raise UsageError(f"--serve {self.serve!r}: {err}") from None
        if not words:
            raise UsageError("--serve is empty")
        return words

    def urls(self) -> list[str]:
        """The servers the job asks: --server, else the --serve engine's."""
        serve = self.serve_argv()
        if self.servers:
            return list(self.servers)
        if serve is None:
            raise UsageError("regen: --server URL (a running engine) or --serve CMD is required")
        return [engine_url(serve)]

    def check(self) -> None:
        if not self.inputs:
            raise UsageError("regen: --input PATH is required")
        if not self.out:
            raise UsageError("regen: --out PATH is required")
        for flag in ("--input", "--out", "--server", "--run-dir", "--resume"):
            if flag in self.flags:
                raise UsageError(f"regen: {flag} is dflashctl regen's own flag, not a --regen-arg")
        self.urls()

    def regen_argv(self, python: str, run_dir: str) -> list[str]:
        argv = [python, "-m", REGEN_MODULE, "--input", *self.inputs, "--out", self.out]
        for url in self.urls():
            argv += ["--server", url]
        argv += [*self.flags, "--run-dir", run_dir]
        return [*argv, "--resume"] if self.resume else argv

    def info(self, release: str, session: str) -> dict[str, Any]:
        return {
            "inputs": list(self.inputs),
            "out": self.out,
            "servers": self.urls(),
            "serve": self.serve,
            "flags": list(self.flags),
            "resume": self.resume,
            "release": release,
            "session": session,
        }


@dataclass(frozen=True)
class RegenStarted:
    host: str
    job_id: str
    release: str
    session: str
    argv: list[str]
    directory: str
    engine: list[str] | None


@dataclass(frozen=True)
class RegenReport:
    """The job status script's answer: the job, the lines past the asked one, the release."""

    job: RegenJob | None
    new_lines: list[str] = field(default_factory=list)
    release: str | None = None
    capable: bool = False

    @property
    def running(self) -> bool:
        """Its job still runs (or restarts): what a follow waits out."""
        return self.job is not None and self.job.live


def parse_report(stdout: str) -> RegenReport:
    sections = split_sections(stdout)
    current = sections.get("current", "").strip()
    new = sanitize_for_terminal(sections.get("new", ""))
    return RegenReport(
        job=parse_regen_job(sections),
        new_lines=[ln for ln in new.splitlines() if ln.strip()],
        release=current.rsplit("/", 1)[-1] if current else None,
        capable=sections.get("capable", "").strip() == "yes",
    )


class RegenControl(DetachedControl):
    """Start, read, follow and stop one host's regeneration job through a Transport (the
    plumbing measure and the eval/gate jobs share: `dflashctl.runs.detached`)."""

    error = RegenError

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        super().__init__(transport, host, regen_session(host.session))
        self.layout = RemoteLayout(host.workdir)

    async def report(
        self, from_line: int = 0, wait_s: float = 0.0, job_id: str | None = None
    ) -> RegenReport:
        argv = regen_status_argv(self.host.workdir, self.session, from_line, wait_s, job_id)
        return parse_report(await self._status(argv, wait_s))

    async def start(self, req: RegenRequest) -> RegenStarted:
        req.check()
        name = self.host.name
        now = await self.report()
        if now.job is not None and now.job.live:
            raise RegenBusy(
                f"{name}: regeneration job {now.job.id} is {now.job.state} (since {now.job.since}) "
                f"in tmux session {self.session!r}: `dflashctl regen {name} --status` shows it, "
                "`--stop` ends it"
            )
        if now.release is None:
            raise RegenError(f"{name}: nothing deployed; run `dflashctl deploy {name}`")
        serve = req.serve_argv()
        if serve is not None:
            training = await RunControl(self.transport, self.host).reader.status_for("regen")
            if training.state in LIVE_STATES:
                raise RegenBusy(
                    f"{name}: a training run is {training.state} in tmux session {self.host.session!r}: "
                    "an engine started here (--serve) would share its devices; give --server URL "
                    f"of an engine elsewhere, or `dflashctl stop {name}` first"
                )
        if not now.capable:
            raise RegenError(
                f"{name}: release {now.release} has no {REGEN_SOURCE} (deployed before "
                "trainer.regen existed); deploy a newer tree"
            )
        info = req.info(now.release, self.session)
        jid = await self._prepare(regen_prepare_argv(self.host.workdir), info, "job directory")
        run_dir = self.layout.path(regen_dir(jid))
        job = [
            self.host.python, "-m", SUPERVISOR_MODULE, *self.host.supervisor_policy().cli_args(),
            "--child", "regen", "--run-dir", run_dir, "--",
            *req.regen_argv(self.host.python, run_dir),
        ]  # fmt: skip
        wait_url = req.urls()[0] if serve is not None else ""
        windows: list[tuple[str, list[str]]] = []
        if serve is not None:
            windows.append(
                (REGEN_ENGINE_WINDOW, engine_window_command(self.host.workdir, jid, serve))
            )
        wrapper = regen_run_argv(
            self.host.workdir, jid, self.session, wait_url, self.host.python, req.serve_wait_s, job
        )
        windows.append((REGEN_JOB_WINDOW, wrapper))
        await self._run(tmux_kill_session(self.session))  # the last job's dead windows
        env = {
            **self.host.env,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": self.layout.release_dir(now.release),
            "DFLASH_RELEASE": now.release,
        }
        await self._launch(
            regen_session_argv(self.session, windows, cwd=self.host.workdir, env=env),
            run_dir,
            "regeneration job",
            RegenBusy,
        )
        return RegenStarted(name, jid, now.release, self.session, job, run_dir, serve)

    async def follow(
        self,
        on_line: Callable[[str], None],
        on_note: Callable[[str], None],
        *,
        job_id: str,
        from_line: int = 0,
        poll_s: float = FOLLOW_POLL_S,
        backoff: Backoff | None = None,
    ) -> RegenJob:
        """Pass each new status.log line of job `job_id` to `on_line` until it ends; a dropped
        link is retried (the job goes on: it lives in tmux), each drop and reconnect one
        `on_note`."""

        async def fetch(seen: int) -> RegenReport:
            rep = await self.report(from_line + seen, poll_s, job_id)
            if rep.job is None:
                raise RegenError(f"{self.host.name}: regeneration job {job_id} is gone")
            return rep

        what = "the regeneration job"
        rep, _ = await self._follow(fetch, lambda r: r.new_lines, on_line, on_note, what, backoff)
        assert rep.job is not None  # fetch refuses a report without one
        return rep.job

    async def stop(self) -> RegenJob | None:
        """SIGINT the running job's supervisor (trainer.regen stops, the engine is stopped);
        its session is killed when it has not ended within STOP_WAIT_S. None: none running."""
        rep = await self.report()
        job = rep.job
        if job is None or not job.live:
            return None
        res = await self._run(regen_stop_argv(self.host.workdir, job.id))
        if res.ok and res.stdout.strip():
            loop = asyncio.get_running_loop()
            deadline = loop.time() + STOP_WAIT_S
            while loop.time() < deadline:
                now = await self.report(0, 5.0, job.id)
                if now.job is not None and not now.job.live:
                    return now.job
        await self._run(tmux_kill_session(self.session))
        after = await self.report(0, 0.0, job.id)
        return after.job or replace(job, state="stopped")
