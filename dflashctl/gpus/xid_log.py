"""Xids: the driver's GPU errors, read from the node's kernel log (pure parsers).

XIDs are not an nvidia-smi query field: the driver prints them to the kernel log
(`NVRM: Xid (PCI:0000:3b:00): 79, pid=..., name=..., GPU has fallen off the bus.`), which is
the *node's* (an unprivileged container cannot read it): `kernel_log_argv()` on the node,
`parse_xid_lines()` on its output (dmesg or journalctl, any prefix). `dflashctl.gpus.xid_reader`
runs them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import datetime

from dflashctl.gpus.nvidia_smi import normalize_bus_id


def kernel_log_argv(since_s: int = 3600) -> list[str]:
    """The node's kernel log for the last `since_s` seconds (run on the Proxmox node)."""
    return ["journalctl", "-k", "--no-pager", "-o", "short-iso", "--since", f"-{int(since_s)}s"]


@dataclass(frozen=True)
class Xid:
    bus_id: str  # normalised "0000:3b:00"
    code: int
    pid: int | None
    process: str | None
    detail: str  # the driver's text after pid/name
    stamp: str  # what precedes "NVRM:" (dmesg "[ 1843.308145]" or journalctl's date/host)
    line: int  # 1-based, in the parsed text

    @property
    def key(self) -> tuple[str, str, int, str]:
        """Identity across overlapping reads of the log."""
        return (self.stamp, self.bus_id, self.code, self.detail)


_XID_RE = re.compile(
    r"NVRM: Xid \(PCI:(?P<bus>[0-9a-fA-F]{4,8}:[0-9a-fA-F]{2}:[0-9a-fA-F]{2}(?:\.[0-7])?)\): "
    r"(?P<code>\d+)(?:, (?P<rest>.*))?$"
)
_PID_RE = re.compile(r"^pid=(?:'?(?P<pid>\d+)'?|'?<unknown>'?), ")
_NAME_RE = re.compile(r"^name=(?:'(?P<q>[^']*)'|(?P<bare>[^,]*)), ")

XID_TEXT: dict[int, str] = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing (a user application fault)",
    45: "preemptive cleanup (a process was killed or hung)",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint/warning",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapper failure",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}


def parse_xid_lines(text: str) -> list[Xid]:
    """Every `NVRM: Xid` line in dmesg or journalctl output; other lines are ignored."""
    out: list[Xid] = []
    for n, line in enumerate(text.splitlines(), 1):
        m = _XID_RE.search(line.rstrip())
        if m is None:
            continue
        bus = normalize_bus_id(m.group("bus"))
        if bus is None:
            continue
        rest = m.group("rest") or ""
        pid: int | None = None
        process: str | None = None
        pm = _PID_RE.match(rest)
        if pm:
            pid = int(pm.group("pid")) if pm.group("pid") else None
            rest = rest[pm.end() :]
            nm = _NAME_RE.match(rest)
            if nm:
                name = nm.group("q") if nm.group("q") is not None else nm.group("bare")
                process = None if name in {"<unknown>", ""} else name
                rest = rest[nm.end() :]
        stamp = line[: m.start()].strip()
        stamp = re.sub(r"\s*kernel:\s*$", "", stamp)
        out.append(Xid(bus, int(m.group("code")), pid, process, rest.strip(), stamp, n))
    return out


_ISO_STAMP_RE = re.compile(
    r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(?:\.\d+)?(?:Z|[+-]\d{2}:?\d{2}))\s"
)


def xid_wall_time(x: Xid) -> float | None:
    """When the kernel logged `x` (epoch seconds), where its stamp says: journalctl's
    `-o short-iso` prefix does; dmesg's seconds since boot do not (None)."""
    m = _ISO_STAMP_RE.match(x.stamp + " ")
    if m is None:
        return None
    try:
        return datetime.fromisoformat(m.group(1).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None
