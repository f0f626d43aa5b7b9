"""Remote execution: the workdir layout (`layout`), pure argv builders (`commands`: pct, tmux,
files; `run`, `release`, `probe`), the Transport protocol, SSH and local transports.

asyncssh is imported only here (dflashctl.remote.ssh), lazily, so local-only use and the
command builders never need it loaded.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from dflashctl.remote import commands
from dflashctl.remote.transport import (
    CommandResult,
    CommandTimeout,
    HostKeyError,
    HostUnreachable,
    LocalTransport,
    Transport,
    TransportError,
)

if TYPE_CHECKING:
    from dflashctl.remote.ssh import SshTransport

__all__ = [
    "CommandResult",
    "CommandTimeout",
    "HostKeyError",
    "HostUnreachable",
    "LocalTransport",
    "SshTransport",
    "Transport",
    "TransportError",
    "commands",
]


def __getattr__(name: str) -> Any:
    if name == "SshTransport":
        from dflashctl.remote.ssh import SshTransport

        return SshTransport
    raise AttributeError(name)
