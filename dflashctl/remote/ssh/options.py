"""What every SSH piece shares: the asyncssh.connect options for an inventory host (identity
file, agent, keepalive, known_hosts), the errors that mean the link is gone, and
HostSetupError for a host whose local setup is unusable. Pure: no connection is made here.
"""

from __future__ import annotations

from typing import Any

import asyncssh

from dflashctl.config.inventory import HostConfig, InventoryError
from dflashctl.remote.transport import TransportError

KEEPALIVE_INTERVAL = 15.0
KEEPALIVE_COUNT_MAX = 3
LINK_ERRORS = (OSError, asyncssh.Error, EOFError)
"""What asyncssh raises when the link (not the command) failed."""


class HostSetupError(InventoryError, TransportError):
    """A host's local setup (identity file, known_hosts) is unusable: a config error (exit 2).

    Also a TransportError, so per-host views (status, the TUI) show it as that host's problem
    without stopping the others.
    """


def where(host: HostConfig) -> str:
    """`/path/hosts.toml: host 'pve-a'`: where a bad setting comes from, as inventory errors say."""
    return f"{host.inventory}: host {host.name!r}" if host.inventory else f"host {host.name!r}"


def client_keys(host: HostConfig) -> Any:
    """asyncssh's client_keys for the host: its identity_file, or asyncssh's defaults."""
    if host.identity_file is None:
        return ()  # asyncssh defaults: ~/.ssh/id_* (and the agent, if enabled)
    if not host.identity_file.exists():
        raise HostSetupError(f"{where(host)}: identity_file: {host.identity_file} does not exist")
    return [str(host.identity_file)]


def connect_options(host: HostConfig) -> dict[str, Any]:
    """asyncssh.connect kwargs; known_hosts is always a real file, never None."""
    return {
        "host": host.address,
        "port": host.port,
        "username": host.user,
        "known_hosts": str(host.known_hosts),
        "client_keys": client_keys(host),
        "agent_path": () if host.use_agent else None,
        "agent_forwarding": False,
        "config": [],
        "connect_timeout": host.connect_timeout,
        "keepalive_interval": KEEPALIVE_INTERVAL,
        "keepalive_count_max": KEEPALIVE_COUNT_MAX,
    }
