"""GPU health where nvidia-smi and the kernel log report it: ECC, clock-event reasons, XIDs.

Pure argv builders and parsers (issue 12 item 6); the wiring runs them through a transport.

- `health_query_argv()` asks `nvidia-smi --query-gpu` for ECC counts and the clock-event
  ("throttle") reasons. Drivers from 535 name the reasons `clocks_event_reasons.*`; older ones
  only know `clocks_throttle_reasons.*`, and nvidia-smi fails the whole query on one unknown
  field (`Field "X" is not a valid field to query.`, exit 2): `unknown_query_field(stderr)`
  tells the caller to retry with `LEGACY_REASONS_PREFIX`. Parse with the same field tuple.
- XIDs are not a query field: the driver prints them to the kernel log
  (`NVRM: Xid (PCI:0000:3b:00): 79, pid=..., name=..., GPU has fallen off the bus.`), which is
  the *node's* (an unprivileged container cannot read it): `kernel_log_argv()` on the node,
  `parse_xid_lines()` on its output (dmesg or journalctl, any prefix).
- `gpu_events(prev, new, xids)` turns two successive readings into events: an uncorrected ECC
  count that rose, a harmful clock-event reason that became active (and "cleared" when it
  stops), each new XID. `sw_power_cap` and idle/application-clock reasons are normal under a
  training load and are recorded, never events.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

from dflashctl.alerts.events import EventKind, WatchEvent

__all__ = [
    "HARMFUL_REASONS",
    "LEGACY_REASONS_PREFIX",
    "REASONS_PREFIX",
    "GpuEvent",
    "GpuEventKind",
    "GpuHealth",
    "Xid",
    "as_watch_events",
    "gpu_events",
    "health_fields",
    "health_query_argv",
    "kernel_log_argv",
    "normalize_bus_id",
    "parse_health_csv",
    "parse_xid_lines",
    "unknown_query_field",
    "xid_wall_time",
]

REASONS_PREFIX = "clocks_event_reasons"
LEGACY_REASONS_PREFIX = "clocks_throttle_reasons"

# NVML's nvmlClocksEventReasons bits (the `.active` field prints them as 0x%016x)
REASON_BITS: dict[str, int] = {
    "gpu_idle": 0x1,
    "applications_clocks_setting": 0x2,
    "sw_power_cap": 0x4,
    "hw_slowdown": 0x8,
    "sync_boost": 0x10,
    "sw_thermal_slowdown": 0x20,
    "hw_thermal_slowdown": 0x40,
    "hw_power_brake_slowdown": 0x80,
    "display_clock_setting": 0x100,
}
QUERIED_REASONS = (
    "hw_slowdown",
    "hw_thermal_slowdown",
    "hw_power_brake_slowdown",
    "sw_thermal_slowdown",
    "sw_power_cap",
)
HARMFUL_REASONS = frozenset(
    {"hw_slowdown", "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown"}
)
_REASON_TEXT = {
    "hw_slowdown": "HW slowdown (clocks cut by the board: power or thermal)",
    "hw_thermal_slowdown": "HW thermal slowdown",
    "hw_power_brake_slowdown": "HW power brake (external power-brake signal)",
    "sw_thermal_slowdown": "SW thermal slowdown",
}

_BASE_FIELDS = (
    "index",
    "pci.bus_id",
    "ecc.mode.current",
    "ecc.errors.corrected.volatile.total",
    "ecc.errors.uncorrected.volatile.total",
    "ecc.errors.uncorrected.aggregate.total",
)


def health_fields(reasons_prefix: str = REASONS_PREFIX) -> tuple[str, ...]:
    """The `--query-gpu` fields, in the order `parse_health_csv` reads them."""
    reasons = tuple(f"{reasons_prefix}.{r}" for r in QUERIED_REASONS)
    return (*_BASE_FIELDS, f"{reasons_prefix}.active", *reasons)


def health_query_argv(reasons_prefix: str = REASONS_PREFIX) -> list[str]:
    return [
        "nvidia-smi",
        "--query-gpu=" + ",".join(health_fields(reasons_prefix)),
        "--format=csv,noheader,nounits",
    ]


_UNKNOWN_FIELD_RE = re.compile(r'Field "([^"]+)" is not a valid field to query')


def unknown_query_field(stderr: str) -> str | None:
    """The field nvidia-smi refused (an older driver), or None."""
    m = _UNKNOWN_FIELD_RE.search(stderr)
    return m.group(1) if m else None


def kernel_log_argv(since_s: int = 3600) -> list[str]:
    """The node's kernel log for the last `since_s` seconds (run on the Proxmox node)."""
    return ["journalctl", "-k", "--no-pager", "-o", "short-iso", "--since", f"-{int(since_s)}s"]


# --- nvidia-smi CSV ---------------------------------------------------------------------------


@dataclass(frozen=True)
class GpuHealth:
    index: int
    bus_id: str | None  # normalised "0000:3b:00" (domain:bus:device), as Xid lines name it
    ecc_mode: str | None  # "Enabled" | "Disabled"; None where ECC does not exist
    ecc_corrected_volatile: int | None
    ecc_uncorrected_volatile: int | None
    ecc_uncorrected_aggregate: int | None
    reasons_mask: int | None  # the `.active` bitmask
    reasons: frozenset[str]  # active reasons, from the flags and the mask

    @property
    def harmful(self) -> frozenset[str]:
        return self.reasons & HARMFUL_REASONS


_NA = re.compile(r"^\[?(N/A|Not Supported|Unknown Error|Insufficient Permissions|GPU is lost)\]?$")


def _na(v: str) -> bool:
    return v == "" or _NA.match(v) is not None


def _count(v: str) -> int | None:
    if _na(v):
        return None
    if not v.isdigit():
        raise ValueError(f"not a count: {v!r}")
    return int(v)


def _flag(v: str) -> bool | None:
    if _na(v):
        return None
    if v == "Active":
        return True
    if v == "Not Active":
        return False
    raise ValueError(f"not Active/Not Active: {v!r}")


def _mask(v: str) -> int | None:
    if _na(v):
        return None
    if not re.fullmatch(r"0x[0-9a-fA-F]{1,16}", v):
        raise ValueError(f"not a hex bitmask: {v!r}")
    return int(v, 16)


def normalize_bus_id(v: str) -> str | None:
    """`00000000:3B:00.0` (nvidia-smi) and `0000:3b:00` (Xid lines) -> `0000:3b:00`."""
    m = re.fullmatch(r"([0-9a-fA-F]{4,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})(?:\.[0-7])?", v.strip())
    if m is None:
        return None
    domain = int(m.group(1), 16)
    return f"{domain:04x}:{m.group(2).lower()}:{m.group(3).lower()}"


def parse_health_csv(
    stdout: str, fields: Sequence[str] | None = None
) -> tuple[list[GpuHealth], list[str]]:
    """Records for the rows that parse; one error line per row that does not (never raises)."""
    fields = tuple(fields or health_fields())
    col = {f: i for i, f in enumerate(fields)}
    prefix = next(f.rsplit(".", 1)[0] for f in fields if f.endswith(".active"))
    out: list[GpuHealth] = []
    errors: list[str] = []
    for n, line in enumerate(stdout.splitlines(), 1):
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) != len(fields):
            errors.append(f"nvidia-smi line {n}: {len(cells)} fields, expected {len(fields)}")
            continue
        try:
            if not cells[col["index"]].isdigit():
                raise ValueError(f"not a GPU index: {cells[col['index']]!r}")
            mask = _mask(cells[col[f"{prefix}.active"]])
            active = {r for r, bit in REASON_BITS.items() if mask is not None and mask & bit}
            for r in QUERIED_REASONS:
                flag = _flag(cells[col[f"{prefix}.{r}"]])
                if flag:
                    active.add(r)
                elif flag is False and mask is None:
                    active.discard(r)
            mode = cells[col["ecc.mode.current"]]
            out.append(
                GpuHealth(
                    index=int(cells[col["index"]]),
                    bus_id=normalize_bus_id(cells[col["pci.bus_id"]]),
                    ecc_mode=None if _na(mode) else mode,
                    ecc_corrected_volatile=_count(
                        cells[col["ecc.errors.corrected.volatile.total"]]
                    ),
                    ecc_uncorrected_volatile=_count(
                        cells[col["ecc.errors.uncorrected.volatile.total"]]
                    ),
                    ecc_uncorrected_aggregate=_count(
                        cells[col["ecc.errors.uncorrected.aggregate.total"]]
                    ),
                    reasons_mask=mask,
                    reasons=frozenset(active),
                )
            )
        except ValueError as err:
            errors.append(f"nvidia-smi line {n}: {err}")
    return out, errors


# --- kernel log -------------------------------------------------------------------------------


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


# --- events -----------------------------------------------------------------------------------


class GpuEventKind(StrEnum):
    ECC_UNCORRECTED = "ecc-uncorrected"
    THROTTLED = "throttled"
    THROTTLE_CLEARED = "throttle-cleared"
    XID = "xid"


@dataclass(frozen=True)
class GpuEvent:
    kind: GpuEventKind
    gpu: int | None  # None: an Xid on a bus no GPU row names
    detail: str


def gpu_events(
    prev: Mapping[int, GpuHealth] | None,
    new: Iterable[GpuHealth],
    xids: Iterable[Xid] = (),
) -> list[GpuEvent]:
    """Events between two readings (prev None: the first reading, where any count is news)."""
    prev = prev or {}
    new = list(new)
    out: list[GpuEvent] = []
    for g in new:
        p = prev.get(g.index)
        for label, now_v, was_v in (
            ("volatile", g.ecc_uncorrected_volatile, p.ecc_uncorrected_volatile if p else None),
            ("aggregate", g.ecc_uncorrected_aggregate, p.ecc_uncorrected_aggregate if p else None),
        ):
            if now_v and now_v > (was_v or 0):
                out.append(
                    GpuEvent(
                        GpuEventKind.ECC_UNCORRECTED,
                        g.index,
                        f"GPU {g.index}: uncorrected ECC errors ({label}) {was_v or 0} -> {now_v}",
                    )
                )
                break  # volatile and aggregate rise together: one event
        was = p.harmful if p else frozenset()
        for r in sorted(g.harmful - was):
            out.append(
                GpuEvent(GpuEventKind.THROTTLED, g.index, f"GPU {g.index}: {_REASON_TEXT[r]}")
            )
        for r in sorted(was - g.harmful):
            out.append(
                GpuEvent(
                    GpuEventKind.THROTTLE_CLEARED,
                    g.index,
                    f"GPU {g.index}: {_REASON_TEXT[r]} cleared",
                )
            )
    by_bus = {g.bus_id: g.index for g in new if g.bus_id}
    for x in xids:
        gpu = by_bus.get(x.bus_id)
        where = f"GPU {gpu}" if gpu is not None else f"PCI {x.bus_id}"
        known = XID_TEXT.get(x.code)
        text = f"{where}: Xid {x.code}" + (f" ({known})" if known else "")
        if x.process:
            text += f", process {x.process}" + (f" (pid {x.pid})" if x.pid else "")
        if x.detail:
            text += f": {x.detail}"
        out.append(GpuEvent(GpuEventKind.XID, gpu, text))
    return out


_WATCH_KIND = {
    GpuEventKind.ECC_UNCORRECTED: EventKind.GPU_ERROR,
    GpuEventKind.XID: EventKind.GPU_ERROR,
    GpuEventKind.THROTTLED: EventKind.GPU_THROTTLED,
    GpuEventKind.THROTTLE_CLEARED: EventKind.GPU_CLEARED,
}


def as_watch_events(host: str, at: float, events: Iterable[GpuEvent]) -> list[WatchEvent]:
    """GPU events as watch events, so they are printed and notified like the run's."""
    return [WatchEvent(host, _WATCH_KIND[e.kind], at, e.detail) for e in events]
