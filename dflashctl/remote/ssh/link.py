"""The one SSH connection to a host: opened on first use (host key verified against the pinned
known_hosts), reused by every command, re-opened after a drop, and each way of failing to open
it turned into one line naming the host (HostKeyError, HostSetupError, HostUnreachable).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

import asyncssh

from dflashctl.config.inventory import HostConfig
from dflashctl.remote.ssh.hostkeys import host_key_message, known_hosts_of, raise_if_key_changed
from dflashctl.remote.ssh.options import LINK_ERRORS, HostSetupError, connect_options, where
from dflashctl.remote.transport import HostKeyError, HostUnreachable


class SshLink:
    """The connection to `host`; `on_open` runs each time a new one is opened."""

    def __init__(
        self, host: HostConfig, overrides: dict[str, Any], on_open: Callable[[], None]
    ) -> None:
        self.host = host
        self._overrides = overrides
        self._on_open = on_open
        self._conn: asyncssh.SSHClientConnection | None = None
        self._lock = asyncio.Lock()

    def is_open(self) -> bool:
        return self._conn is not None and not self._conn.is_closed()

    async def connection(self) -> asyncssh.SSHClientConnection:
        """The open connection, opening one when there is none (or it was closed)."""
        async with self._lock:
            if self._conn is not None and not self._conn.is_closed():
                return self._conn
            self._conn = None
            self._conn = await self._open()
            self._on_open()
            return self._conn

    async def _open(self) -> asyncssh.SSHClientConnection:
        host = self.host
        known = known_hosts_of(host)
        if known is None:
            raise HostKeyError(host_key_message(host))
        opts = {**connect_options(host), "known_hosts": known, **self._overrides}
        try:
            return await asyncio.wait_for(asyncssh.connect(**opts), host.connect_timeout + 5)
        except asyncssh.HostKeyNotVerifiable:
            raise HostKeyError(host_key_message(host)) from None
        except (asyncssh.KeyImportError, asyncssh.KeyEncryptionError) as err:
            raise HostSetupError(
                f"{where(host)}: cannot use identity_file {host.identity_file}: "
                f"{err} (encrypted keys: load them into ssh-agent and set use_agent = true)"
            ) from None
        except asyncssh.PermissionDenied:
            raise HostUnreachable(
                f"{host.name}: {host.user}@{host.address}:{host.port} "
                f"rejected our key (check identity_file / agent)"
            ) from None
        except (TimeoutError, *LINK_ERRORS) as err:
            if isinstance(err, asyncssh.Error | ConnectionResetError | EOFError):
                await raise_if_key_changed(host)  # the handshake was cut short
            reason = str(err) or type(err).__name__
            raise HostUnreachable(
                f"{host.name}: cannot connect to {host.address}:{host.port}: {reason}"
            ) from None

    def drop(self) -> None:
        """Abort the connection (a link error): the next command opens a new one."""
        if self._conn is not None:
            self._conn.abort()
            self._conn = None

    def forget_if_closed(self) -> bool:
        """True (and forgotten) when the connection is gone; False while it is open."""
        if self.is_open():
            return False
        self._conn = None
        return True

    async def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            with contextlib.suppress(*LINK_ERRORS):
                await self._conn.wait_closed()
            self._conn = None
