"""SSH to a Proxmox node with asyncssh, and `pct exec` into the container.

Host keys are always verified against the inventory's known_hosts file; the only way a key gets
there is `trust_host` (explicit fetch, fingerprint, confirmation). One connection per host is
reused for every command and re-opened after a drop.

Every command is bounded on the node itself (`timeout`, see commands.bounded): sshd keeps a
session, and its slot under MaxSessions, until the command behind it exits, whatever the client
does with the channel. Channels per connection are counted by a semaphore, and a slot is only
given back once sshd has closed the channel, so polling, a live `logs -f` and timed-out
commands never run the node out of sessions.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import asyncssh

from dflashctl.inventory import HostConfig, InventoryError
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
from dflashctl.remote.transport import (
    CommandResult,
    CommandTimeout,
    HostKeyError,
    HostUnreachable,
    TransportError,
    timeout_message,
)
from trainer.config.validation import NotUtf8Error, utf8_text

KEEPALIVE_INTERVAL = 15.0
KEEPALIVE_COUNT_MAX = 3
# After the node's own bound (limit, then KILL_AFTER_S) has passed, how long its answer may take
# to arrive before the link, not the command, is taken to be what is stuck.
REPLY_GRACE_S = 5.0
_LINK_ERRORS = (OSError, asyncssh.Error, EOFError)


class HostSetupError(InventoryError, TransportError):
    """A host's local setup (identity file, known_hosts) is unusable: a config error (exit 2).

    Also a TransportError, so per-host views (status, the TUI) show it as that host's problem
    without stopping the others.
    """


def known_hosts_pattern(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def _where(host: HostConfig) -> str:
    """`/path/hosts.toml: host 'pve-a'`: where a bad setting comes from, as inventory errors say."""
    return f"{host.inventory}: host {host.name!r}" if host.inventory else f"host {host.name!r}"


def read_known_hosts(path: Path) -> asyncssh.SSHKnownHosts | None:
    """The parsed known_hosts file (None if missing); ValueError with a one-line reason."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as err:
        raise ValueError(f"cannot read it: {err.strerror}") from None
    try:
        return asyncssh.import_known_hosts(utf8_text(data))
    except NotUtf8Error as err:
        raise ValueError(str(err)) from None
    except (ValueError, asyncssh.KeyImportError) as err:
        raise ValueError(f"not a known_hosts file: {err}") from None


def _known_hosts(host: HostConfig) -> asyncssh.SSHKnownHosts | None:
    try:
        return read_known_hosts(host.known_hosts)
    except ValueError as err:
        raise HostSetupError(f"{host.known_hosts}: {err} (known_hosts of {_where(host)})") from None


def pinned_keys(known_hosts: Path, address: str, port: int) -> list[asyncssh.SSHKey]:
    """Keys pinned for address:port in `known_hosts` ([] if the file or entry is missing)."""
    try:
        kh = read_known_hosts(known_hosts)
    except ValueError as err:
        raise HostSetupError(f"{known_hosts}: {err}") from None
    if kh is None:
        return []
    return list(kh.match(address, address, port if port != 22 else None)[0])


def _host_key_message(host: HostConfig, presented: asyncssh.SSHKey | None = None) -> str:
    pinned = pinned_keys(host.known_hosts, host.address, host.port)
    if pinned:
        now = ""
        if presented is not None:
            types = ", ".join(sorted({k.get_algorithm() for k in pinned}))
            now = (
                f" (it now presents a {presented.get_algorithm()} key "
                f"{presented.get_fingerprint('sha256')}; pinned: {types})"
            )
        return (
            f"{host.name}: host key of {host.address}:{host.port} CHANGED from the one pinned in "
            f"{host.known_hosts}{now}; refusing to connect (if the host was reinstalled, remove "
            f"its line there and run `dflashctl trust {host.name}`)"
        )
    return (
        f"{host.name}: no pinned host key for {host.address}:{host.port} in {host.known_hosts}; "
        f"run `dflashctl trust {host.name}` first"
    )


def _client_keys(host: HostConfig) -> Any:
    if host.identity_file is None:
        return ()  # asyncssh defaults: ~/.ssh/id_* (and the agent, if enabled)
    if not host.identity_file.exists():
        raise HostSetupError(f"{_where(host)}: identity_file: {host.identity_file} does not exist")
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
        self._slots = asyncio.Semaphore(host.max_channels)
        self._lock = asyncio.Lock()
        self._reapers: set[asyncio.Task[None]] = set()

    async def _connection(self) -> asyncssh.SSHClientConnection:
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            self._conn = None
            known = _known_hosts(self.host)
            if known is None:
                raise HostKeyError(_host_key_message(self.host))
            opts = {**connect_options(self.host), "known_hosts": known, **self._overrides}
            try:
                conn = await asyncio.wait_for(
                    asyncssh.connect(**opts), self.host.connect_timeout + 5
                )
            except asyncssh.HostKeyNotVerifiable:
                raise HostKeyError(_host_key_message(self.host)) from None
            except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as err:
                raise HostSetupError(
                    f"{_where(self.host)}: cannot use identity_file {self.host.identity_file}: "
                    f"{err} (encrypted keys: load them into ssh-agent and set use_agent = true)"
                ) from None
            except asyncssh.PermissionDenied:
                raise HostUnreachable(
                    f"{self.host.name}: {self.host.user}@{self.host.address}:{self.host.port} "
                    f"rejected our key (check identity_file / agent)"
                ) from None
            except (TimeoutError, *_LINK_ERRORS) as err:
                if isinstance(err, asyncssh.Error | ConnectionResetError | EOFError):
                    await self._unless_key_changed()  # the handshake was cut short
                reason = str(err) or type(err).__name__
                raise HostUnreachable(
                    f"{self.host.name}: cannot connect to {self.host.address}:{self.host.port}: "
                    f"{reason}"
                ) from None
            self._conn = conn
            # A fresh connection has all its sessions: slots still held by channels of a
            # dropped one must not count against it.
            self._slots = asyncio.Semaphore(self.host.max_channels)
            return conn

    async def _unless_key_changed(self) -> None:
        """Raise HostKeyError when a failed handshake was really a host key change.

        asyncssh offers only the pinned key types; a node that has none of them (say it now
        has an RSA key only where an ed25519 one is pinned) drops the handshake, which reads
        as "connection lost". Asking for its key without that restriction tells the two apart.
        """
        pinned = pinned_keys(self.host.known_hosts, self.host.address, self.host.port)
        if not pinned:
            return
        try:
            key = await asyncio.wait_for(
                asyncssh.get_server_host_key(self.host.address, self.host.port, config=[]),
                self.host.connect_timeout,
            )
        except (TimeoutError, *_LINK_ERRORS):
            return  # really unreachable
        if key is None:
            return
        presented = key.export_public_key()
        if all(k.export_public_key() != presented for k in pinned):
            raise HostKeyError(_host_key_message(self.host, key))

    def _drop(self) -> None:
        if self._conn is not None:
            self._conn.abort()
            self._conn = None

    def wrap(self, argv: Sequence[str]) -> str:
        """The exact command string sent to the node's shell for a stream (see node_guarded)."""
        return shell_join(node_guarded(pct_exec(self.host.ctid, clean_env(argv))))

    async def run_host(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Run an argv on the Proxmox node itself (pct status, ...)."""
        return await self._run_command(list(argv), input, timeout, describe(argv))

    async def run(
        self, argv: Sequence[str], *, input: bytes | None = None, timeout: float | None = None
    ) -> CommandResult:
        """Run a container argv; `timeout` defaults to the host's command_timeout."""
        node_argv = pct_exec(self.host.ctid, clean_env(argv))
        return await self._run_command(node_argv, input, timeout, describe(argv))

    async def _slot(self, what: str, limit: float, left: float | None = None) -> asyncio.Semaphore:
        """Take one of the connection's channel slots within `left` (default `limit`) seconds."""
        slots = self._slots
        try:
            await asyncio.wait_for(slots.acquire(), limit if left is None else max(0.0, left))
        except TimeoutError:
            raise CommandTimeout(
                f"{what} on host {self.host.name}: not started within {limit:g} s: all "
                f"{self.host.max_channels} SSH channels to {self.host.address} are in use "
                f"(max_channels) by commands still running there"
            ) from None
        return slots

    def _release_when_closed(
        self, proc: asyncssh.SSHClientProcess[bytes] | None, slots: asyncio.Semaphore
    ) -> None:
        """Give the slot back once sshd has closed the channel (its session is then free)."""
        if proc is None:
            slots.release()
            return
        if proc.exit_status is None and proc.exit_signal is None:
            # Abandoned (timed out, cancelled): ask sshd to end it (TERM reaches `timeout`,
            # which passes it on to the whole group; sshd without privilege separation refuses,
            # and the node-side bound ends it anyway), then close our side.
            with contextlib.suppress(*_LINK_ERRORS):
                proc.send_signal("TERM")
            proc.close()

        async def reap() -> None:
            try:
                with contextlib.suppress(*_LINK_ERRORS):
                    await proc.wait_closed()
            finally:
                slots.release()

        task = asyncio.get_running_loop().create_task(reap())
        self._reapers.add(task)
        task.add_done_callback(self._reapers.discard)

    async def _run_command(
        self, node_argv: list[str], input: bytes | None, timeout: float | None, what: str
    ) -> CommandResult:
        limit = timeout if timeout is not None else self.host.command_timeout
        loop = asyncio.get_running_loop()
        started = loop.time()
        conn = await self._connection()
        slots = await self._slot(what, limit, started + limit - loop.time())
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
            raise CommandTimeout(
                timeout_message(
                    what,
                    self.host.name,
                    limit,
                    "the node did not report it stopped either (link stalled?); "
                    "it is bounded there and ends by itself",
                )
            ) from None
        except asyncssh.ChannelOpenError as err:
            if conn.is_closed():
                self._drop()
                raise HostUnreachable(
                    f"{what} on host {self.host.name}: connection lost: {err.reason}"
                ) from None
            # The connection itself is fine (and may carry a live stream): keep it.
            raise TransportError(
                f"{what} on host {self.host.name}: the node refused a new SSH channel: "
                f"{err.reason} (sshd MaxSessions below max_channels = {self.host.max_channels}?)"
            ) from None
        except _LINK_ERRORS as err:
            self._drop()
            raise HostUnreachable(
                f"{what} on host {self.host.name}: connection lost: {err}"
            ) from None
        finally:
            self._release_when_closed(proc, slots)
        out = done.stdout or b""
        err_b = done.stderr or b""
        assert isinstance(out, bytes) and isinstance(err_b, bytes)
        rc = done.exit_status if done.exit_status is not None else 255
        if rc in TIMED_OUT_RCS and loop.time() - started >= limit:
            raise CommandTimeout(
                timeout_message(what, self.host.name, limit, "the remote command was stopped")
            )
        return CommandResult(
            rc, out.decode("utf-8", "replace"), err_b.decode("utf-8", "replace"), out
        )

    async def stream_lines(self, argv: Sequence[str]) -> AsyncIterator[str]:
        """Yield complete lines from one long-lived channel; raise HostUnreachable on a drop."""
        conn = await self._connection()
        what = describe(argv)
        try:
            slots = await self._slot(what, self.host.command_timeout)
        except CommandTimeout as err:
            raise HostUnreachable(str(err)) from None  # a follower retries this with backoff
        proc: asyncssh.SSHClientProcess[bytes] | None = None
        try:
            try:
                proc = await conn.create_process(self.wrap(argv), encoding=None)
            except _LINK_ERRORS as err:
                if not conn.is_closed() and isinstance(err, asyncssh.ChannelOpenError):
                    raise HostUnreachable(
                        f"{self.host.name}: the node refused a channel for {what}: {err.reason}"
                    ) from None
                self._drop()
                raise HostUnreachable(f"{self.host.name}: cannot open stream: {err}") from None
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
            # (see commands.guarded) kills them, so nothing lingers in the container.
            if proc is not None:
                with contextlib.suppress(*_LINK_ERRORS):
                    proc.stdin.write_eof()
                proc.close()
            self._release_when_closed(proc, slots)

    async def container_state(self) -> str:
        res = await self.run_host(pct_status(self.host.ctid))
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
        for task in list(self._reapers):
            task.cancel()
        self._reapers.clear()
