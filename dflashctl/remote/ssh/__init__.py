"""SSH to a Proxmox node with asyncssh, and `pct exec` into the container; asyncssh is imported
only under this package. One module per job:

- `options`: asyncssh.connect options for a host (identity, agent, keepalive), link errors,
  HostSetupError;
- `hostkeys`: known_hosts read, match, pin (`dflashctl trust`) and the changed-key check;
- `link`: the one connection per host, opened lazily, reused, re-opened after a drop;
- `slots`: the connection's channel slots (max_channels), freed only once sshd closed a channel;
- `transport`: SshTransport, commands and streams over the link within the slots.
"""

from __future__ import annotations

from dflashctl.remote.ssh.hostkeys import (
    fetch_host_key,
    known_hosts_pattern,
    pin_host_key,
    pinned_keys,
    read_known_hosts,
)
from dflashctl.remote.ssh.options import (
    KEEPALIVE_COUNT_MAX,
    KEEPALIVE_INTERVAL,
    HostSetupError,
    connect_options,
)
from dflashctl.remote.ssh.transport import REPLY_GRACE_S, SshTransport

__all__ = [
    "KEEPALIVE_COUNT_MAX",
    "KEEPALIVE_INTERVAL",
    "REPLY_GRACE_S",
    "HostSetupError",
    "SshTransport",
    "connect_options",
    "fetch_host_key",
    "known_hosts_pattern",
    "pin_host_key",
    "pinned_keys",
    "read_known_hosts",
]
