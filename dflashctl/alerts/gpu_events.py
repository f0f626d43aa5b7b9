"""GPU readings -> events: what changed between two readings is news for the watch (pure).

`gpu_events(prev, new, xids)` turns two successive readings into events: an uncorrected ECC
count that rose, a harmful clock-event reason that became active (and "cleared" when it
stops), each new XID. `sw_power_cap` and idle/application-clock reasons are normal under a
training load and are recorded, never events.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from dflashctl.alerts.events import EventKind, WatchEvent
from dflashctl.gpus.nvidia_smi import REASON_TEXT, GpuHealth
from dflashctl.gpus.xid_log import XID_TEXT, Xid


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
                GpuEvent(GpuEventKind.THROTTLED, g.index, f"GPU {g.index}: {REASON_TEXT[r]}")
            )
        for r in sorted(was - g.harmful):
            out.append(
                GpuEvent(
                    GpuEventKind.THROTTLE_CLEARED,
                    g.index,
                    f"GPU {g.index}: {REASON_TEXT[r]} cleared",
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
