"""SSH to a Proxmox node with asyncssh, and `pct exec` into the container.

Host keys are always verified against the inventory's known_hosts file; the only way a key gets
there is `trust_host` (explicit fetch, fingerprint, confirmation). One connection per host is
reused for every command and re-opened after a drop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncssh

from dflashctl.inventory import HostConfig
from dflashctl.remote.commands import (
    clean_env,
    parse_pct_status,
    pct_exec,
    pct_status,
    shell_join,
)
from dflashctl.remote.transport import (
    CommandResult,
    CommandTimeout,
    HostKeyError,
    HostUnreachable,
    TransportError,
)

KEEPALIVE_INTERVAL = 15.0
KEEPALIVE_COUNT_MAX = 3
_LINK_ERRORS = (OSError, asyncssh.Error, EOFError)


def known_hosts_pattern(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def pinned_keys(known_hosts: Path, address: str, port: int) -> list[asyncssh.SSHKey]:
    """Keys pinned for address:port in `known_hosts` ([] if the file or entry is missing)."""
    if not known_hosts.exists():
        return []
    kh = asyncssh.read_known_hosts(str(known_hosts))
    return list(kh.match(address, address, port if port != 22 else None)[0])


def _host_key_message(host: HostConfig) -> str:
    if pinned_keys(host.known_hosts, host.address, host.port):
        return (
            f"{host.name}: host key of {host.address}:{host.port} CHANGED from the one pinned in "
            f"{host.known_hosts}; refusing to connect (if the host was reinstalled, remove its "
            f"line there and run `dflashctl trust {host.name}`)"
        )
    return (
        f"{host.name}: no pinned host key for {host.address}:{host.port} in {host.known_hosts}; "
        f"run `dflashctl trust {host.name}` first"
    )


def _client_keys(host: HostConfig) -> Any:
    if host.identity_file is None:
        return ()  # asyncssh defaults: ~/.ssh/id_* (and the agent, if enabled)
    if not host.identity_file.exists():
        raise TransportError(f"{host.name}: identity_file {host.identity_file} does not exist")
    return [str(host.identity_file)]


def connect_options(host: HostConfig) -> dict[str, Any]:
    """asyncssh.connect kwargs; known_hosts is always a real file, never None."""
    return {
        "host": host.address,
        "port": host.port,
        "username": host.user,
        "known_hosts": str(host.known_hosts),
        "client_keys": _client_keys(host),
        "agent_path": () if host.use_agent else None,
        "agent_forwarding": False,
        "config": [],
        "connect_timeout": host.connect_timeout,
        "keepalive_interval": KEEPALIVE_INTERVAL,
        "keepalive_count_max": KEEPALIVE_COUNT_MAX,
    }


async def fetch_host_key(host: HostConfig) -> asyncssh.SSHKey:
    """The key the server presents now (unverified: only for showing before pinning)."""
    try:
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(host.address, host.port, config=[]),
            host.connect_timeout,
        )
    except (TimeoutError, *_LINK_ERRORS) as err:
        raise HostUnreachable(
            f"{host.name}: cannot reach {host.address}:{host.port}: {err}"
        ) from None
    if key is None:
        raise HostUnreachable(f"{host.name}: {host.address}:{host.port} presented no host key")
    return key


def pin_host_key(host: HostConfig, key: asyncssh.SSHKey) -> bool:
    """Append the key to the inventory's known_hosts; False if it was already pinned."""
    line_key = key.export_public_key().decode().strip()
    for existing in pinned_keys(host.known_hosts, host.address, host.port):
        if existing.export_public_key().decode().strip() == line_key:
            return False
    host.known_hosts.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(host.known_hosts, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as f:
        f.write(f"{known_hosts_pattern(host.address, host.port)} {line_key}\n")
    return True


class SshTransport:
    """Transport over one asyncssh connection to the Proxmox node owning the container."""

    def __init__(self, host: HostConfig, **overrides: Any) -> None:
        self.host = host
        self.label = host.name
        self._overrides = overrides
        self._conn: asyncssh.SSHClientConnection | None = None
        self._lock = asyncio.Lock()

    async def _connection(self) -> asyncssh.SSHClientConnection:
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            self._conn = None
            opts = {**connect_options(self.host), **self._overrides}
            if not self.host.known_hosts.exists():
                raise HostKeyError(_host_key_message(self.host))
            try:
                self._conn = await asyncio.wait_for(
                    asyncssh.connect(**opts), self.host.connect_timeout + 5
                )
            except asyncssh.HostKeyNotVerifiable:
                raise HostKeyError(_host_key_message(self.host)) from None
            except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as err:
                raise TransportError(
                    f"{self.host.name}: cannot use identity_file {self.host.identity_file}: {err} "
                    f"(encrypted keys: load them into ssh-agent and set use_agent = true)"
                ) from None
            except asyncssh.PermissionDenied:
                raise HostUnreachable(
                    f"{self.host.name}: {self.host.user}@{self.host.address}:{self.host.port} "
                    f"rejected our key (check identity_file / agent)"
                ) from None
            except (TimeoutError, *_LINK_ERRORS) as err:
                reason = str(err) or type(err).__name__
                raise HostUnreachable(
                    f"{self.host.name}: cannot connect to {self.host.address}:{self.host.port}: "
                    f"{reason}"
                ) from None
            return self._conn

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.abort()
            self._conn = None

    def wrap(self, argv: Sequence[str]) -> str:
        """The exact command string sent to the node's shell."""
        return shell_join(pct_exec(self.host.ctid, clean_env(argv)))

    async def run_host(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Run an argv on the Proxmox node itself (pct status, ...)."""
        return await self._run_command(shell_join(argv), input, timeout, str(argv[0]))

    async def run(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        return await self._run_command(self.wrap(argv), input, timeout, str(argv[0]))

    async def _run_command(
        self, command: str, input: bytes | None, timeout: float | None, what: str
    ) -> CommandResult:
        limit = timeout if timeout is not None else self.host.command_timeout
        conn = await self._connection()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + limit
        proc: asyncssh.SSHClientProcess[bytes] | None = None
        try:
            # Deadlines cover channel open too: a half-dead link must not hang forever.
            proc = await asyncio.wait_for(
                conn.create_process(command, input=input or b"", encoding=None), limit
            )
            done = await asyncio.wait_for(proc.wait(), max(0.0, deadline - loop.time()))
        except TimeoutError:
            raise CommandTimeout(
                f"{self.host.name}: {what} did not finish within {limit:g}s; killed"
            ) from None
        except _LINK_ERRORS as err:
            self._drop()
            raise HostUnreachable(
                f"{self.host.name}: connection lost during {what}: {err}"
            ) from None
        finally:
            if proc is not None and proc.exit_status is None:
                # Ask the node to kill it, then close the channel (its stdin/stdout go away).
                with contextlib.suppress(*_LINK_ERRORS):
                    proc.send_signal("KILL")
                proc.close()
        out = done.stdout or b""
        err_b = done.stderr or b""
        assert isinstance(out, bytes) and isinstance(err_b, bytes)
        rc = done.exit_status if done.exit_status is not None else 255
        return CommandResult(
            rc, out.decode("utf-8", "replace"), err_b.decode("utf-8", "replace"), out
        )

    async def stream_lines(self, argv: Sequence[str]) -> AsyncIterator[str]:
        """Yield complete lines from one long-lived channel; raise HostUnreachable on a drop."""
        conn = await self._connection()
        try:
            proc = await conn.create_process(self.wrap(argv), encoding=None)
        except _LINK_ERRORS as err:
            self._drop()
            raise HostUnreachable(f"{self.host.name}: cannot open stream: {err}") from None
        try:
            while True:
                try:
                    raw = await proc.stdout.readline()
                except _LINK_ERRORS as err:
                    self._drop()
                    raise HostUnreachable(f"{self.host.name}: stream lost: {err}") from None
                if not raw.endswith(b"\n"):
                    if self._conn is None or self._conn.is_closed():
                        self._conn = None
                        raise HostUnreachable(f"{self.host.name}: connection closed mid-stream")
                    break
                yield raw[:-1].decode("utf-8", "replace")
        finally:
            # Closing the channel closes the remote stdin: the guard around streaming helpers
            # (see control.guarded) kills them, so nothing lingers in the container.
            with contextlib.suppress(*_LINK_ERRORS):
                proc.stdin.write_eof()
            proc.close()

    async def container_state(self) -> str:
        res = await self.run_host(pct_status(self.host.ctid), timeout=self.host.connect_timeout * 3)
        if not res.ok:
            raise TransportError(
                f"{self.host.name}: pct status {self.host.ctid}: {res.error_line()}"
            )
        return parse_pct_status(res.stdout)

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(*_LINK_ERRORS):
                await self._conn.wait_closed()
            self._conn = None
