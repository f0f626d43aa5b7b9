"""SshTransport: run container argvs (`pct exec` on the Proxmox node) and node argvs over the
host's one SSH connection (link), within its channel slots (slots).

Every command is bounded on the node itself (`timeout`, see commands.bounded): sshd keeps a
session, and its slot under MaxSessions, until the command behind it exits, whatever the client
does with the channel.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Sequence
from typing import Any

import asyncssh

from dflashctl.config.inventory import HostConfig
from dflashctl.remote.commands import (
    KILL_AFTER_S,
    TIMED_OUT_RCS,
    bounded,
    clean_env,
    describe,
    node_guarded,
    shell_join,
)
from dflashctl.remote.pct import parse_pct_status, pct_exec, pct_status
from dflashctl.remote.ssh.link import SshLink
from dflashctl.remote.ssh.options import LINK_ERRORS
from dflashctl.remote.ssh.slots import ChannelSlots
from dflashctl.remote.transport import (
    CommandResult,
    CommandTimeout,
    HostUnreachable,
    TransportError,
    no_answer,
)

# After the node's own bound (limit, then KILL_AFTER_S) has passed, how long its answer may take
# to arrive before the link, not the command, is taken to be what is stuck.
REPLY_GRACE_S = 5.0
# How long the node gets to answer `pct status` when a container command's answer never came.
NODE_PROBE_S = 5.0
LINK_STALLED = "(link stalled?); it is bounded there and ends by itself"


def unanswered(limit: float, ctid: int, node_state: str | None) -> str:
    """Why a container command's answer never came, as far as the node tells (`node_state`:
    what it answered to `pct status`; None: nothing, so the link is what stalled).

    A frozen container (`pct suspend`, `lxc-freeze`) is `running` to the node, and `pct exec`
    into it blocks in lxc-attach until it is thawed: a fine link, a silent container."""
    if node_state is None:
        return no_answer(
            limit, f"the node did not answer `pct status {ctid}` either {LINK_STALLED}"
        )
    if node_state != "running":
        return no_answer(limit, f"the node says container {ctid} is {node_state} (`pct status`)")
    return (
        f"no answer within {limit:g} s from container {ctid}, though the node answers "
        f"(`pct status {ctid}`: running): the container is not responding (frozen? `pct resume "
        f"{ctid}` thaws it); the command waits on the node until the container runs again"
    )


def unasked(limit: float, ctid: int, channels: int) -> str:
    """A container command's answer never came, and the node cannot be asked why: every
    channel is held by a command that has not ended (what a frozen container's commands do)."""
    return no_answer(
        limit,
        f"all {channels} SSH channels are held by commands that have not ended, so the node "
        f"cannot be asked about container {ctid} (frozen? `pct resume {ctid}` thaws it)",
    )


class SshTransport:
    """Transport over one asyncssh connection to the Proxmox node owning the container."""

    def __init__(self, host: HostConfig, **overrides: Any) -> None:
        self.host = host
        self.label = host.name
        self._slots = ChannelSlots(host)
        self._link = SshLink(host, overrides, on_open=self._slots.reset)

    async def _connection(self) -> asyncssh.SSHClientConnection:
        return await self._link.connection()

    def wrap(self, argv: Sequence[str]) -> str:
        """The exact command string sent to the node's shell for a stream (see node_guarded)."""
        return shell_join(node_guarded(pct_exec(self.host.ctid, clean_env(argv))))

    async def run_host(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Run an argv on the Proxmox node itself (pct status, ...)."""
        return await self._run_command(list(argv), input, timeout, describe(argv), container=False)

    async def run(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Run a container argv; `timeout` defaults to the host's command_timeout."""
        node_argv = pct_exec(self.host.ctid, clean_env(argv))
        return await self._run_command(node_argv, input, timeout, describe(argv))

    async def _run_command(
        self,
        node_argv: list[str],
        input: bytes | None,
        timeout: float | None,
        what: str,
        *,
        container: bool = True,
    ) -> CommandResult:
        limit = timeout if timeout is not None else self.host.command_timeout
        loop = asyncio.get_running_loop()
        started = loop.time()
        conn = await self._connection()
        slot = await self._slots.take(what, limit, started + limit - loop.time())
        # The node ends the command at the limit (KILL KILL_AFTER_S later); its answer gets
        # REPLY_GRACE_S more to arrive. Past that, the link is what is stuck.
        remote_limit = max(0.1, started + limit - loop.time())
        give_up = started + limit + KILL_AFTER_S + REPLY_GRACE_S
        proc: asyncssh.SSHClientProcess[bytes] | None = None
        try:
            # Deadlines cover channel open too: a half-dead link must not hang forever.
            # Without input the channel's stdin stays open, and a guard on the node watches it:
            # closing the channel (giving up, cancellation) ends the command there at once.
            command = bounded(node_argv, remote_limit, watch_channel=input is None)
            opened: asyncssh.SSHClientProcess[bytes] = await asyncio.wait_for(
                conn.create_process(shell_join(command), encoding=None),
                max(0.0, give_up - loop.time()),
            )
            proc = opened
            if input is not None:
                opened.stdin.write(input)
                opened.stdin.write_eof()  # also for b"": an empty file is still a whole file
            done = await asyncio.wait_for(opened.wait(), max(0.0, give_up - loop.time()))
        except TimeoutError:
            if not container:
                detail = no_answer(
                    limit, f"the node did not report it stopped either {LINK_STALLED}"
                )
            elif self._slots.all_taken():  # a channel to ask the node on would not come either
                detail = unasked(limit, self.host.ctid, self.host.max_channels)
            else:  # ask the node what it knows of the container: is the link at fault?
                detail = unanswered(limit, self.host.ctid, await self._node_state())
            raise CommandTimeout.of_command(what, self.host.name, detail) from None
        except asyncssh.ChannelOpenError as err:
            if conn.is_closed():
                self._link.drop()
                raise HostUnreachable.of_command(
                    what, self.host.name, f"connection lost: {err.reason}"
                ) from None
            # The connection itself is fine (and may carry a live stream): keep it.
            raise TransportError.of_command(
                what,
                self.host.name,
                f"the node refused a new SSH channel: {err.reason} (sshd MaxSessions below "
                f"max_channels = {self.host.max_channels}?)",
            ) from None
        except LINK_ERRORS as err:
            self._link.drop()
            raise HostUnreachable.of_command(
                what, self.host.name, f"connection lost: {err}"
            ) from None
        finally:
            self._slots.release_when_closed(proc, slot)
        out = done.stdout or b""
        err_b = done.stderr or b""
        assert isinstance(out, bytes) and isinstance(err_b, bytes)
        rc = done.exit_status if done.exit_status is not None else 255
        if rc in TIMED_OUT_RCS and loop.time() - started >= limit:
            raise CommandTimeout.of_command(
                what, self.host.name, no_answer(limit, "the remote command was stopped")
            )
        return CommandResult(
            rc, out.decode("utf-8", "replace"), err_b.decode("utf-8", "replace"), out
        )

    async def stream_lines(self, argv: Sequence[str]) -> AsyncIterator[str]:
        """Yield complete lines from one long-lived channel; raise HostUnreachable on a drop."""
        conn = await self._connection()
        what = describe(argv)
        try:
            slot = await self._slots.take(what, self.host.command_timeout)
        except CommandTimeout as err:
            raise HostUnreachable(str(err)) from None  # a follower retries this with backoff
        proc: asyncssh.SSHClientProcess[bytes] | None = None
        try:
            try:
                proc = await conn.create_process(self.wrap(argv), encoding=None)
            except LINK_ERRORS as err:
                if not conn.is_closed() and isinstance(err, asyncssh.ChannelOpenError):
                    raise HostUnreachable(
                        f"{self.host.name}: the node refused a channel for {what}: {err.reason}"
                    ) from None
                self._link.drop()
                raise HostUnreachable(f"{self.host.name}: cannot open stream: {err}") from None
            while True:
                try:
                    raw = await proc.stdout.readline()
                except LINK_ERRORS as err:
                    self._link.drop()
                    raise HostUnreachable(f"{self.host.name}: stream lost: {err}") from None
                if not raw.endswith(b"\n"):
                    if self._link.forget_if_closed():
                        raise HostUnreachable(f"{self.host.name}: connection closed mid-stream")
                    break
                yield raw[:-1].decode("utf-8", "replace")
        finally:
            # Closing the channel closes the remote stdin: the guard around streaming helpers
            # (see commands.guarded) kills them, so nothing lingers in the container.
            if proc is not None:
                with contextlib.suppress(*LINK_ERRORS):
                    proc.stdin.write_eof()
                proc.close()
            self._slots.release_when_closed(proc, slot)

    async def _node_state(self) -> str | None:
        """The container's state as the node answers `pct status` now (None: no answer)."""
        try:
            res = await self.run_host(pct_status(self.host.ctid), timeout=NODE_PROBE_S)
        except TransportError:
            return None
        return parse_pct_status(res.stdout) if res.ok else f"unknown ({res.error_line()})"

    async def container_state(self) -> str:
        res = await self.run_host(pct_status(self.host.ctid))
        if not res.ok:
            raise TransportError(
                f"{self.host.name}: pct status {self.host.ctid}: {res.error_line()}"
            )
        return parse_pct_status(res.stdout)

    async def close(self) -> None:
        await self._link.close()
        self._slots.close()
