"""The Transport protocol and the local implementation.

A Transport runs *container-side* argvs. SshTransport wraps them in `pct exec` on a Proxmox
node; LocalTransport runs them on this machine (demo, tests without SSH). Deploy and run control
are written once against this protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, Self, runtime_checkable

from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.remote.commands import describe


class TransportError(DflashctlError):
    """A remote operation failed for transport reasons (one-line message naming the host).

    `label` (the host) and `detail` (what went wrong there) are kept apart when one command
    failed (`of_command`) or the container refused it, so an operation that ran that command
    as one of its steps can report the failure as its own (`during`).
    """

    exit_code = ExitCode.FAILED

    def __init__(
        self,
        message: str = "",
        *,
        hint: str | None = None,
        label: str | None = None,
        detail: str | None = None,
        command: str | None = None,
    ) -> None:
        super().__init__(message, hint=hint)
        self.label = label
        self.detail = detail
        self.command = command  # the failed command, as `describe` words it

    @classmethod
    def of_command(cls, what: str, label: str, detail: str) -> Self:
        """`status on host pve-a: no answer within 5 s; the remote command was stopped`."""
        return cls(f"{what} on host {label}: {detail}", label=label, detail=detail, command=what)

    def during(self, operation: str, step: str) -> TransportError:
        """This failure as `operation`'s, whose `step` ran the command: `logs on host pve-a:
        reading the run's status: no answer within 5 s; ...`. A failure that is not one
        command's (a connection, a host key) is returned as it is: it already says it all."""
        if self.label is None or self.detail is None:
            return self
        where = f"{step}: " if self.command is not None else ""
        return type(self)(
            f"{operation} on host {self.label}: {where}{self.detail}",
            hint=self.hint,
            label=self.label,
            detail=self.detail,
            command=self.command,
        )


class HostUnreachable(TransportError):
    """The host could not be reached or the link dropped: CLI exit code 3."""

    exit_code = ExitCode.UNREACHABLE


class HostKeyError(HostUnreachable):
    """The host key is unknown or changed: never bypassed, only `dflashctl trust` pins keys."""


class CommandTimeout(TransportError):
    """A command ran past its timeout. The message says what, where, and whether it was ended."""


def no_answer(seconds: float, outcome: str) -> str:
    """A timed-out command's detail: `no answer within 5 s; the remote command was stopped`."""
    return f"no answer within {seconds:g} s; {outcome}"


@dataclass(frozen=True)
class CommandResult:
    rc: int
    stdout: str
    stderr: str
    stdout_bytes: bytes = b""

    @property
    def ok(self) -> bool:
        return self.rc == 0

    def error_line(self) -> str:
        """The most useful single line of stderr (or stdout) for an error message."""
        for text in (self.stderr, self.stdout):
            lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
            if lines:
                return lines[-1]
        return f"exit status {self.rc}"


@runtime_checkable
class NodeCommands(Protocol):
    """A transport that can also run an argv on the Proxmox node itself, outside the
    container (the node's kernel log, `pct status`)."""

    async def run_host(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult: ...


@runtime_checkable
class Transport(Protocol):
    label: str

    async def run(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult: ...

    def stream_lines(self, argv: Sequence[str]) -> AsyncIterator[str]: ...

    async def container_state(self) -> str: ...

    async def close(self) -> None: ...


def _decode(data: bytes) -> str:
    return data.decode("utf-8", errors="replace")


async def _kill_group(proc: asyncio.subprocess.Process) -> None:
    """SIGKILL the process's group (it leads one: start_new_session) and reap it.

    `proc.kill()` only when the group could not be signalled: it goes through Popen.poll(),
    which can reap the just-killed child before asyncio's child watcher does, and the watcher
    then logs "Unknown child process pid N, will report returncode 255" to the user's terminal.
    """
    if proc.returncode is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass  # the group is gone: the process has exited and only awaits reaping
    except PermissionError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
    await proc.wait()


class LocalTransport:
    """Runs container argvs as local processes, each in its own process group.

    A timeout or cancellation kills the whole group, so no helper (tail, sleep loops) outlives
    the local command that started it.
    """

    def __init__(
        self,
        *,
        env: Mapping[str, str] | None = None,
        label: str = "local",
        command_timeout: float | None = 120.0,
    ) -> None:
        self.label = label
        self.command_timeout = command_timeout
        self._env = {**os.environ, **(env or {})}
        self._procs: set[asyncio.subprocess.Process] = set()

    async def run_host(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Run an argv on the node: here the node and the "container" are this machine."""
        return await self.run(argv, input=input, timeout=timeout)

    async def run(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        try:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.PIPE if input is not None else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                env=self._env,
                start_new_session=True,
            )
        except FileNotFoundError:
            return CommandResult(127, "", f"{argv[0]}: command not found")
        self._procs.add(proc)
        limit = timeout if timeout is not None else self.command_timeout
        try:
            out, err = await asyncio.wait_for(proc.communicate(input), limit)
        except TimeoutError:
            await _kill_group(proc)
            assert limit is not None
            raise CommandTimeout.of_command(
                describe(argv), self.label, no_answer(limit, "the command was killed")
            ) from None
        except BaseException:
            await _kill_group(proc)
            raise
        finally:
            self._procs.discard(proc)
        return CommandResult(proc.returncode or 0, _decode(out), _decode(err), out)

    async def stream_lines(self, argv: Sequence[str]) -> AsyncIterator[str]:
        """Yield complete stdout lines (without newline) until the process ends."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,  # held open: closing it stops guarded helpers
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            env=self._env,
            start_new_session=True,
        )
        self._procs.add(proc)
        assert proc.stdout is not None
        try:
            while True:
                raw = await proc.stdout.readline()
                if not raw.endswith(b"\n"):
                    break  # EOF (a trailing partial line is incomplete: not delivered)
                yield _decode(raw[:-1])
        finally:
            if proc.stdin is not None:
                proc.stdin.close()
            await _kill_group(proc)
            self._procs.discard(proc)

    async def container_state(self) -> str:
        return "running"

    async def close(self) -> None:
        for proc in list(self._procs):
            await _kill_group(proc)
        self._procs.clear()
