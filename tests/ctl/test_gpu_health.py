"""GPU health parsers on nvidia-smi and kernel-log text in the exact printed formats.

The fixtures under fixtures/gpu-health/ reproduce what nvidia-smi prints for
`health_query_argv()` with `--format=csv,noheader,nounits` (", "-separated; `[N/A]` where a
board has no ECC, `[Not Supported]` where it lacks a reason, `Active`/`Not Active` flags, the
`.active` bitmask as 0x%016x) on an 8x H100 node (driver 550), a 2x RTX 4090 workstation and
a 2x A100 node on a pre-535 driver (legacy `clocks_throttle_reasons.*` names), plus the
driver's Xid lines as dmesg and `journalctl -k -o short-iso` print them.
"""

from __future__ import annotations

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from dflashctl.alerts.events import EventKind
from dflashctl.alerts.gpu_events import GpuEventKind, as_watch_events, gpu_events
from dflashctl.alerts.policy import flush
from dflashctl.gpus.nvidia_smi import (
    LEGACY_REASONS_PREFIX,
    GpuHealth,
    health_fields,
    health_query_argv,
    normalize_bus_id,
    parse_health_csv,
    unknown_query_field,
)
from dflashctl.gpus.xid_log import kernel_log_argv, parse_xid_lines

FIX = Path(__file__).parent / "fixtures" / "gpu-health"


def read(name: str) -> str:
    return (FIX / name).read_text()


def test_argv_is_the_exact_query() -> None:
    argv = health_query_argv()
    assert argv[0] == "nvidia-smi" and argv[2] == "--format=csv,noheader,nounits"
    assert argv[1] == (
        "--query-gpu=index,pci.bus_id,ecc.mode.current,"
        "ecc.errors.corrected.volatile.total,ecc.errors.uncorrected.volatile.total,"
        "ecc.errors.uncorrected.aggregate.total,clocks_event_reasons.active,"
        "clocks_event_reasons.hw_slowdown,clocks_event_reasons.hw_thermal_slowdown,"
        "clocks_event_reasons.hw_power_brake_slowdown,clocks_event_reasons.sw_thermal_slowdown,"
        "clocks_event_reasons.sw_power_cap"
    )
    legacy = health_query_argv(LEGACY_REASONS_PREFIX)[1]
    assert "clocks_throttle_reasons.hw_slowdown" in legacy and "clocks_event" not in legacy
    assert kernel_log_argv(600) == [
        "journalctl", "-k", "--no-pager", "-o", "short-iso", "--since", "-600s",
    ]  # fmt: skip


def test_h100_node() -> None:
    gpus, errors = parse_health_csv(read("h100x8-driver550.csv"))
    assert errors == [] and [g.index for g in gpus] == list(range(8))
    g0, g1, g4, g5 = gpus[0], gpus[1], gpus[4], gpus[5]
    assert g0.bus_id == "0000:18:00" and g0.ecc_mode == "Enabled"
    assert (g0.ecc_uncorrected_volatile, g0.reasons, g0.reasons_mask) == (0, frozenset(), 0)
    assert g1.reasons == {"sw_power_cap"} and g1.harmful == frozenset()  # normal under load
    assert gpus[2].reasons == {"gpu_idle"} and gpus[2].ecc_corrected_volatile == 2
    assert g4.reasons_mask == 0x48 and g4.harmful == {"hw_slowdown", "hw_thermal_slowdown"}
    assert (g5.ecc_uncorrected_volatile, g5.ecc_uncorrected_aggregate) == (1, 3)


def test_consumer_board_without_ecc_or_power_brake() -> None:
    gpus, errors = parse_health_csv(read("rtx4090-driver550.csv"))
    assert errors == []
    assert [(g.ecc_mode, g.ecc_uncorrected_volatile) for g in gpus] == [(None, None)] * 2
    assert gpus[0].harmful == frozenset() and gpus[1].harmful == {"sw_thermal_slowdown"}


def test_legacy_driver_names_and_the_fallback_signal() -> None:
    stderr = read("driver470-unknown-field.stderr")
    assert unknown_query_field(stderr) == "clocks_event_reasons.active"
    assert unknown_query_field("No devices were found") is None
    gpus, errors = parse_health_csv(
        read("a100x2-driver470-legacy.csv"), health_fields(LEGACY_REASONS_PREFIX)
    )
    assert errors == []
    assert gpus[0].harmful == {"hw_slowdown", "hw_power_brake_slowdown"}
    assert gpus[1].ecc_mode == "Disabled" and gpus[1].ecc_uncorrected_aggregate is None


def test_a_bad_row_is_one_error_and_the_others_parse() -> None:
    good = read("h100x8-driver550.csv").splitlines()
    text = "\n".join(
        [
            good[0],
            "1, 00000000:2A:00.0, Enabled, 0, 0, 0, 0x4, Maybe, Not Active, Not Active, Not Active, Active",
            "2, 00000000:3A:00.0, Enabled, 0, 0",
            "No devices were found",
            good[3],
        ]
    )
    gpus, errors = parse_health_csv(text)
    assert [g.index for g in gpus] == [0, 3]
    assert [e.split(":")[0] for e in errors] == [
        "nvidia-smi line 2",
        "nvidia-smi line 3",
        "nvidia-smi line 4",
    ]
    assert "Maybe" in errors[0]


def test_bus_ids_match_between_nvidia_smi_and_xid_lines() -> None:
    assert normalize_bus_id("00000000:3B:00.0") == normalize_bus_id("0000:3b:00") == "0000:3b:00"
    assert normalize_bus_id("garbage") is None


def test_xid_lines_from_dmesg() -> None:
    xids = parse_xid_lines(read("dmesg-xid.txt"))
    assert [(x.bus_id, x.code) for x in xids] == [
        ("0000:3b:00", 79),
        ("0000:18:00", 48),
        ("0000:18:00", 63),
        ("0000:01:00", 32),
        ("0000:00:1e", 31),
    ]  # the "GPU has fallen off the bus" follow-up and the NVSwitch SXid are not Xids
    x79, x48 = xids[0], xids[1]
    assert (x79.pid, x79.process, x79.detail) == (2096908, "python3", "GPU has fallen off the bus.")
    assert x79.stamp == "[ 1843.308151]" and x79.line == 4
    assert (x48.pid, x48.process) == (None, None)
    assert x48.detail.startswith("An uncorrectable double bit error (DBE)")
    assert xids[3].detail == "Channel ID 00000009 intr 00800000" and xids[3].pid is None
    assert xids[4].detail == ""


def test_xid_lines_from_journalctl() -> None:
    xids = parse_xid_lines(read("journalctl-xid.txt"))
    assert [x.code for x in xids] == [94, 119, 13]
    assert xids[0].stamp == "2026-11-30T03:12:09+0000 gpu-node-1"
    assert xids[0].detail == "Contained: SM (0x1). RST: No, D-RST: No"
    assert xids[2].process is None and xids[2].detail.startswith("Graphics Exception")
    assert len({x.key for x in xids}) == 3


def test_events_between_readings() -> None:
    before, _ = parse_health_csv(read("h100x8-driver550.csv"))
    first = gpu_events(None, before)  # the first reading: current trouble is news
    assert [(e.kind, e.gpu) for e in first] == [
        (GpuEventKind.THROTTLED, 4),
        (GpuEventKind.THROTTLED, 4),
        (GpuEventKind.ECC_UNCORRECTED, 5),
    ]
    assert [e.detail for e in first[:2]] == [
        "GPU 4: HW slowdown (clocks cut by the board: power or thermal)",
        "GPU 4: HW thermal slowdown",
    ]
    prev = {g.index: g for g in before}
    assert gpu_events(prev, before) == []  # nothing changed: nothing to say

    g4 = prev[4]
    cooled = GpuHealth(g4.index, g4.bus_id, "Enabled", 0, 0, 0, 0x8, frozenset({"hw_slowdown"}))
    g5 = prev[5]
    worse = GpuHealth(g5.index, g5.bus_id, "Enabled", 14, 2, 4, 0x4, frozenset({"sw_power_cap"}))
    after = [cooled if g.index == 4 else worse if g.index == 5 else g for g in before]
    xids = parse_xid_lines(
        "[ 9.0] NVRM: Xid (PCI:0000:ab:00): 48, pid='<unknown>', name=<unknown>, DBE"
    )
    evs = gpu_events(prev, after, xids)
    assert [(e.kind, e.gpu) for e in evs] == [
        (GpuEventKind.THROTTLE_CLEARED, 4),
        (GpuEventKind.ECC_UNCORRECTED, 5),
        (GpuEventKind.XID, 5),  # PCI 0000:ab:00 is GPU 5
    ]
    assert evs[0].detail == "GPU 4: HW thermal slowdown cleared"
    assert evs[1].detail == "GPU 5: uncorrected ECC errors (volatile) 1 -> 2"
    assert evs[2].detail == "GPU 5: Xid 48 (double-bit ECC error): DBE"
    lone = gpu_events(prev, before, parse_xid_lines(read("dmesg-xid.txt"))[:1])
    assert lone[0].gpu is None and lone[0].detail.startswith(
        "PCI 0000:3b:00: Xid 79 (GPU has fallen"
    )

    wev = as_watch_events("node-a", 1_800_000_000.0, evs)
    assert [e.kind for e in wev] == [
        EventKind.GPU_CLEARED,
        EventKind.GPU_ERROR,
        EventKind.GPU_ERROR,
    ]
    notes = flush(wev)
    assert [(n.title, n.severity) for n in notes] == [
        ("dflash node-a: gpu-cleared", "success"),
        ("dflash node-a: gpu-error 2 times", "failure"),
    ]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.text(max_size=40) | st.sampled_from(read("h100x8-driver550.csv").splitlines())))
def test_parsers_never_raise(lines: list[str]) -> None:
    """A garbled row (a driver printing a warning mid-output) costs that row, never the poll."""
    text = "\n".join(lines)
    gpus, errors = parse_health_csv(text)
    assert len(gpus) + len(errors) <= len(text.splitlines())  # one record or error per row
    parse_xid_lines(text)
    parse_xid_lines(text.replace(", ", ": NVRM: Xid (PCI:0000:3b:00): "))
