"""Run control: one host's run as one service (`RunService`) over any Transport.

`RunControl` is the facade the CLI, the TUI, the demo and the watch use. The work is done by
one object per responsibility, reachable as attributes for callers that need more than the
protocol (a group drives its nodes' `starter` and `stopper`):
`reader` (the status snapshot, configs), `log` (status.log: read, follow), `starter`,
`stopper` and `gpu` (nvidia-smi). `restart` composes deploy, stop and start.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.config.inventory import NAME_RE, HostConfig
from dflashctl.gpus.nvidia_smi import GpuHealth, GpuSample
from dflashctl.gpus.reader import GpuReader
from dflashctl.releases.deploy import deploy, push_config_file
from dflashctl.releases.release import Release
from dflashctl.remote.files import write_file_atomic
from dflashctl.remote.layout import CONFIG
from dflashctl.remote.transport import Transport
from dflashctl.runs.follow import FollowEvent
from dflashctl.runs.logs import RunLog
from dflashctl.runs.reader import RunReader
from dflashctl.runs.service import (
    DEFAULT_START_WAIT_S,
    ControlError,
    RestartResult,
    RunService,
    StartResult,
    StopResult,
    job_refusal,
    measure_refusal,
)
from dflashctl.runs.snapshot import RunStatus
from dflashctl.runs.starter import RunStarter
from dflashctl.runs.stopper import RunStopper

if TYPE_CHECKING:
    from dflashctl.releases.resume import CheckpointConfig


class RunControl:
    """Operate one host's run through a Transport (SSH+pct or local)."""

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        self.transport = transport
        self.host = host
        self.reader = RunReader(transport, host)
        self.layout = self.reader.layout
        self.log = RunLog(transport, host)
        self.starter = RunStarter(self.reader, self.log)
        self.stopper = RunStopper(self.reader)
        self.gpu = GpuReader(transport, host.name)

    async def status(self, *, setup_errors: bool = False) -> RunStatus:
        """The run's snapshot (`RunReader.status`): an unreachable host is a state."""
        return await self.reader.status(setup_errors=setup_errors)

    async def deployed_config(self) -> str:
        return await self.reader.deployed_config()

    async def checkpoint_config(self, resume: str = "auto") -> CheckpointConfig | None:
        return await self.reader.checkpoint_config(resume)

    async def gpus(self) -> list[GpuSample]:
        return await self.gpu.gpus()

    async def gpu_health(self) -> list[GpuHealth]:
        return await self.gpu.gpu_health()

    async def start(
        self,
        *,
        fresh: bool = False,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Callable[[str], None] | None = None,
    ) -> StartResult:
        """`RunStarter.start`: under the supervisor, waiting until past setup or dead."""
        return await self.starter.start(
            fresh=fresh, resume=resume, wait_s=wait_s, progress=progress
        )

    async def stop(self, timeout: float = 120.0) -> StopResult:
        """`RunStopper.stop`: SIGINT, wait for the checkpoint line, clear the session."""
        return await self.stopper.stop(timeout)

    async def log_line_count(self) -> int | None:
        return await self.log.log_line_count()

    def tail_log(self, from_line: int) -> AsyncGenerator[str, None]:
        return self.log.tail_log(from_line)

    def follow(
        self,
        from_line: int = 0,
        *,
        delay: Callable[[int], float] | None = None,
        max_attempts: int | None = None,
    ) -> AsyncGenerator[FollowEvent, None]:
        """`RunLog.follow`: status.log forever, across dropped links, as typed events."""
        return self.log.follow(from_line, delay=delay, max_attempts=max_attempts)

    async def push_config(self, path: Path) -> None:
        await push_config_file(self.transport, self.host, path)

    async def put_secret(self, name: str, data: bytes) -> str:
        """Write a secret to WORKDIR/secrets/NAME (0600) through stdin: never on a command line."""
        if not NAME_RE.match(name):
            raise ControlError(f"{self.host.name}: secret name {name!r} is not a plain name")
        path = self.layout.secret(name)
        res = await self.transport.run(write_file_atomic(path, "600"), input=data)
        if not res.ok:
            raise ControlError(f"{self.host.name}: writing {path}: {res.error_line()}")
        return path

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
        GPU hours. The check is the one `deploy --config` makes (dflashctl.releases.resume).
        """
        from dflashctl.config.runconfig import (
            config_diff,
            config_hash_of_file,
            config_hash_of_text,
            read_config_text,
            validate_config,
        )
        from dflashctl.releases.resume import check_config_push

        path = config or self.host.run_config
        if path is not None:  # a bad local config fails before anything touches the host
            new_text = read_config_text(path)
            validate_config(path)
        before = await self.status(setup_errors=True)
        if before.measure is not None:  # refused before the deploy and the stop, not after
            raise measure_refusal(before.measure, self.host.name, "a restarted run")
        if before.job is not None:
            raise job_refusal(before.job, self.host.name, "a restarted run")
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


if TYPE_CHECKING:
    _: type[RunService] = RunControl  # RunControl satisfies the protocol (checked by mypy)
