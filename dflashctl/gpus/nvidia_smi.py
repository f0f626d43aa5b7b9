"""nvidia-smi in the container, read: utilisation samples and GPU health (pure parsers).

- `parse_gpu_csv` reads `remote.run.gpu_query_argv()`'s CSV: one `GpuSample` per GPU.
- `health_query_argv()` asks `nvidia-smi --query-gpu` for ECC counts and the clock-event
  ("throttle") reasons. Drivers from 535 name the reasons `clocks_event_reasons.*`; older ones
  only know `clocks_throttle_reasons.*`, and nvidia-smi fails the whole query on one unknown
  field (`Field "X" is not a valid field to query.`, exit 2): `unknown_query_field(stderr)`
  tells the caller to retry with `LEGACY_REASONS_PREFIX`. Parse with the same field tuple.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

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
REASON_TEXT = {
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


@dataclass(frozen=True)
class GpuSample:
    index: int
    name: str
    util_pct: float | None
    mem_used_mib: float | None
    mem_total_mib: float | None
    temp_c: float | None
    power_w: float | None


def parse_gpu_csv(stdout: str) -> list[GpuSample]:
    def num(v: str) -> float | None:
        try:
            return float(v)
        except ValueError:
            return None  # "[N/A]", "[Not Supported]"

    out: list[GpuSample] = []
    for line in stdout.splitlines():
        cols = [c.strip() for c in line.split(",")]
        if len(cols) != 7 or not cols[0].isdigit():
            continue
        out.append(
            GpuSample(
                int(cols[0]),
                cols[1],
                num(cols[2]),
                num(cols[3]),
                num(cols[4]),
                num(cols[5]),
                num(cols[6]),
            )
        )
    return out


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
