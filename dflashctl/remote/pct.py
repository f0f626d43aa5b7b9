"""Pure argv builders for the Proxmox node's `pct` (the container's exec, status, push) and the
parser of `pct status`. `pct_exec` wraps every container argv; `shell_join` (commands) quotes
the result once for the node's login shell.
"""

from __future__ import annotations

from collections.abc import Sequence


def pct_exec(ctid: int, argv: Sequence[str]) -> list[str]:
    """`pct exec CTID -- argv` ('--' so pct never parses the inner command's options)."""
    return ["pct", "exec", str(int(ctid)), "--", *argv]


def pct_status(ctid: int) -> list[str]:
    return ["pct", "status", str(int(ctid))]


def pct_push(ctid: int, src: str, dst: str) -> list[str]:
    return ["pct", "push", str(int(ctid)), src, dst]


def parse_pct_status(stdout: str) -> str:
    """`status: running` -> "running"; anything unrecognised -> "unknown"."""
    for line in stdout.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "status" and value.strip():
            return value.strip()
    return "unknown"


def pct_config(ctid: int) -> list[str]:
    """`pct config CTID`: the container's configuration as `key: value` lines."""
    return ["pct", "config", str(int(ctid))]
