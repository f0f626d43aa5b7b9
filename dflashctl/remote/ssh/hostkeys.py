"""Host keys: always verified against the inventory's known_hosts file; the only way a key gets
there is `trust_host` (explicit fetch, fingerprint, confirmation: `fetch_host_key`, then
`pin_host_key`). Also the one-line message for a missing or changed key, and the check that
tells a changed key from a dropped handshake.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import asyncssh

from dflashctl.config.inventory import HostConfig
from dflashctl.remote.ssh.options import LINK_ERRORS, HostSetupError, where
from dflashctl.remote.transport import HostKeyError, HostUnreachable
from trainer.config.validation import NotUtf8Error, utf8_text


def known_hosts_pattern(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


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


def known_hosts_of(host: HostConfig) -> asyncssh.SSHKnownHosts | None:
    """The host's parsed known_hosts (None if missing); HostSetupError naming the inventory."""
    try:
        return read_known_hosts(host.known_hosts)
    except ValueError as err:
        raise HostSetupError(f"{host.known_hosts}: {err} (known_hosts of {where(host)})") from None


def pinned_keys(known_hosts: Path, address: str, port: int) -> list[asyncssh.SSHKey]:
    """Keys pinned for address:port in `known_hosts` ([] if the file or entry is missing)."""
    try:
        kh = read_known_hosts(known_hosts)
    except ValueError as err:
        raise HostSetupError(f"{known_hosts}: {err}") from None
    if kh is None:
        return []
    return list(kh.match(address, address, port if port != 22 else None)[0])


def host_key_message(host: HostConfig, presented: asyncssh.SSHKey | None = None) -> str:
    """Why the host's key is refused: none pinned, or changed from the pinned one."""
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


async def _presented_key(host: HostConfig) -> asyncssh.SSHKey | None:
    return await asyncio.wait_for(
        asyncssh.get_server_host_key(host.address, host.port, config=[]), host.connect_timeout
    )


async def fetch_host_key(host: HostConfig) -> asyncssh.SSHKey:
    """The key the server presents now (unverified: only for showing before pinning)."""
    try:
        key = await _presented_key(host)
    except (TimeoutError, *LINK_ERRORS) as err:
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


async def raise_if_key_changed(host: HostConfig) -> None:
    """Raise HostKeyError when a failed handshake was really a host key change.

    asyncssh offers only the pinned key types; a node that has none of them (say it now
    has an RSA key only where an ed25519 one is pinned) drops the handshake, which reads
    as "connection lost". Asking for its key without that restriction tells the two apart.
    """
    pinned = pinned_keys(host.known_hosts, host.address, host.port)
    if not pinned:
        return
    try:
        key = await _presented_key(host)
    except (TimeoutError, *LINK_ERRORS):
        return  # really unreachable
    if key is None:
        return
    presented = key.export_public_key()
    if all(k.export_public_key() != presented for k in pinned):
        raise HostKeyError(host_key_message(host, key))
