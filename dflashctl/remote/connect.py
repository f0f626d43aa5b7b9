"""How dflashctl reaches a host: the transport for an inventory host, and the interactive attach.

Every caller (CLI commands, `dflashctl watch`, the TUI's host handles) opens its transport here,
so tests and the demo swap one factory, and nothing above `remote/` names `SshTransport`.
"""

from __future__ import annotations

from collections.abc import Callable

from dflashctl.config.inventory import HostConfig
from dflashctl.remote.commands import clean_env, pct_exec, shell_join, tmux_attach, with_known_term
from dflashctl.remote.transport import Transport

TransportFactory = Callable[[HostConfig], Transport]
"""Opens the transport to one inventory host (SSH in production; tests pass their own)."""

DEFAULT_TERM = "xterm-256color"


def make_transport(host: HostConfig) -> Transport:
    """The SSH transport to the Proxmox node that owns `host`'s container (connects lazily)."""
    from dflashctl.remote.ssh import SshTransport  # asyncssh is loaded only when a host is used

    return SshTransport(host)


def attach_argv(host: HostConfig, term: str) -> list[str]:
    """The system ssh argv for an interactive attach (host key checked against our file)."""
    attach = with_known_term(tmux_attach(host.session))
    remote = shell_join(pct_exec(host.ctid, clean_env(attach, {"TERM": term})))
    argv = [
        "ssh",
        "-t",
        "-p",
        str(host.port),
        "-o",
        f"UserKnownHostsFile={host.known_hosts}",
        "-o",
        "StrictHostKeyChecking=yes",
        "-o",
        "ForwardAgent=no",
    ]
    if host.identity_file is not None:
        argv += ["-i", str(host.identity_file), "-o", "IdentitiesOnly=yes"]
    return [*argv, f"{host.user}@{host.address}", remote]
