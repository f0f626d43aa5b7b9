"""A node's kernel log read for Xid lines: the one reader `dflashctl watch` and the TUI share.

`XidReader.read(transport, timeout)` runs `journalctl -k` on the Proxmox node (the
transport's `run_host`, outside the container) over the last `XID_WINDOW_S`, parses it with
`gpu_health.parse_xid_lines`, and returns the Xids not in the read before: the windows overlap,
so each Xid is reported once by its key (stamp, bus, code, text). The first read is history
(`XidRead.history`): the watch drops it, the TUI shows it dimmed. A node without journalctl is
asked once; a failed read raises `KernelLogError` (one line) and changes nothing, so the next
read compares against the last good one. Textual-free and stateless apart from the seen keys.
"""

from __future__ import annotations

from dataclasses import dataclass

from dflashctl.errors import DflashctlError
from dflashctl.gpus.xid_log import Xid, kernel_log_argv, parse_xid_lines
from dflashctl.remote.transport import NodeCommands, Transport

__all__ = ["XID_WINDOW_S", "KernelLogError", "XidRead", "XidReader"]

XID_WINDOW_S = 3600
"""The kernel log read back per read (seconds): far wider than any poll interval."""


class KernelLogError(DflashctlError):
    """The node's kernel log could not be read: the query itself failed (`kernel log query
    failed: ...`) or journalctl refused (`journalctl: ...`, e.g. not allowed to read it)."""


@dataclass(frozen=True)
class XidRead:
    """One read's news: the Xids not in the read before, oldest first."""

    fresh: tuple[Xid, ...]
    history: bool
    """The first read: its Xids predate the reader (the watch reports none of them)."""


class XidReader:
    """One node's kernel log, read again and again; remembers the last read's keys."""

    def __init__(self, window_s: int = XID_WINDOW_S) -> None:
        self.window_s = window_s
        self.available = True
        """False once the node turned out to have no journalctl: never asked again."""
        self._seen: set[tuple[str, str, int, str]] | None = None  # None: not read yet

    async def read(self, transport: Transport, timeout: float) -> XidRead | None:
        """The Xids new since the last read; None where there is nothing to read (the
        transport cannot run commands on the node, or the node has no journalctl). Raises
        KernelLogError when the read fails."""
        if not self.available or not isinstance(transport, NodeCommands):
            return None
        try:
            res = await transport.run_host(kernel_log_argv(self.window_s), timeout=timeout)
        except Exception as err:  # a dead link, a timeout: one line, the caller decides
            raise KernelLogError(f"kernel log query failed: {err}") from err
        if res.rc == 127 or "not found" in res.stderr or "No such file" in res.stderr:
            self.available = False
            return None
        if not res.ok:
            raise KernelLogError(f"journalctl: {res.error_line()}")
        xids = parse_xid_lines(res.stdout)
        seen, self._seen = self._seen, {x.key for x in xids}
        if seen is None:
            return XidRead(tuple(xids), history=True)
        return XidRead(tuple(x for x in xids if x.key not in seen), history=False)
