"""Xid errors in the TUI's GPU pane (issue 12 item 6): the node's kernel log, read by the
follower through the transport's `run_host` as `dflashctl watch` reads it, parsed by
`gpu_health.parse_xid_lines`; the first read is history, each later Xid is one toast."""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from rich.text import Text
from textual.widgets import Static

from dflashctl.config.inventory import local_host
from dflashctl.gpus.nvidia_smi import parse_gpu_csv, parse_health_csv
from dflashctl.gpus.xid_log import parse_xid_lines
from dflashctl.gpus.xid_reader import KernelLogError, XidRead, XidReader
from dflashctl.monitor.state import RunState, apply_xids, xid_events
from dflashctl.remote import LocalTransport
from dflashctl.runs.control import RunControl
from dflashctl.tui.app import HostBinding
from dflashctl.tui.screens.host import HostScreen
from dflashctl.tui.widgets.panes import gpus_text, xids_text
from tests import budget
from tests.conftest import require_part
from tests.tui.test_app import _until
from tests.tui.test_supervisor_view import Recording

FIXTURES = Path(__file__).parents[1] / "ctl" / "fixtures" / "gpu-health"
BUS = "00000000:9A:00.0"  # the journalctl fixture's Xids name PCI:0000:9a:00, this GPU
HEALTH_CSV = (
    f"0, {BUS}, Enabled, 0, 0, 0, 0x0000000000000000, Not Active, Not Active, Not Active,"
    " Not Active, Not Active\n"
)
SAMPLE_CSV = "0, NVIDIA H100 80GB HBM3, 97, 71000, 81559, 70, 650.0\n"
NOW = 1_796_011_929.0  # one hour after the journalctl fixture's first Xid


def _fake_tools(tmp_path: Path, kernel_log: Path) -> Path:
    """nvidia-smi answering both of RunControl's queries, journalctl replaying `kernel_log`."""
    (tmp_path / "health.csv").write_text(HEALTH_CSV)
    (tmp_path / "samples.csv").write_text(SAMPLE_CSV)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    scripts = {
        "nvidia-smi": (
            'case "$*" in *clocks_*) cat {h} ;; *) cat {s} ;; esac\n'.format(
                h=tmp_path / "health.csv", s=tmp_path / "samples.csv"
            )
        ),
        "journalctl": f"cat {kernel_log}\n",
    }
    for name, body in scripts.items():
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\n" + body)
        tool.chmod(0o755)
    return bin_dir


def test_the_pane_names_gpu_by_bus_code_meaning_and_age() -> None:
    xids = parse_xid_lines((FIXTURES / "journalctl-xid.txt").read_text())
    health, _ = parse_health_csv(HEALTH_CSV)
    base = replace(RunState("h"), gpus=tuple(parse_gpu_csv(SAMPLE_CSV)), gpu_health=tuple(health))
    history = apply_xids(base, xids, NOW, history=True)
    assert [s.xid.code for s in history.xids] == [94, 119, 13]
    assert [s.at for s in history.xids] == [1_796_008_329.0, 1_796_008_330.0, 1_796_008_331.0]
    assert xid_events(base, history) == []  # what the log held before: history, not news
    assert apply_xids(history, xids, NOW + 10) is history  # the same lines again: nothing new
    lines = gpus_text(history, NOW).plain.splitlines()
    assert lines[-4:] == [
        "kernel log Xids: 3 (3 before this view, dim)",
        "Xid  13 GPU0 9a:00 59m58s  graphics engine exception",
        "Xid 119 GPU0 9a:00 59m59s  GSP RPC timeout",
        "Xid  94 GPU0 9a:00  1h00m  contained ECC error",
    ]
    narrow = gpus_text(history, NOW, width=40).plain.splitlines()
    assert narrow[-3] == "Xid  13 GPU0 9a:00 59m58s  graphics eng…"  # cut to the pane
    # dmesg stamps carry no wall time: the age counts from the read; an unknown code shows
    # the driver's text; a bus no GPU row names has no GPU label
    dmesg = parse_xid_lines((FIXTURES / "dmesg-xid.txt").read_text())
    later = apply_xids(history, dmesg, NOW + 30)
    toasts = xid_events(history, later)
    assert len(toasts) == 5 and toasts[0] == (
        "error",
        "h: PCI 0000:3b:00: Xid 79 (GPU has fallen off the bus), process python3 (pid 2096908):"
        " GPU has fallen off the bus.",
    )
    text = xids_text(later, NOW + 90)
    shown = text.plain.splitlines()
    assert shown[0] == "kernel log Xids: 8 (5 new; 3 before this view, dim)"
    assert shown[1] == "Xid  31 00:1e  1m00s  GPU memory page fault"
    assert shown[2] == "Xid  32 01:00  1m00s  Channel ID 00000009 intr 00800000"
    assert shown[3] == "Xid  63 18:00  1m00s  ECC page retirement or row remapping recorded"
    assert shown[-1] == "+5 older"
    red = {text.plain[s.start : s.end] for s in text.spans if s.style == "bold red"}
    assert "Xid  31 " in red  # news is red, history dim


async def test_the_follower_reads_the_node_kernel_log_and_toasts_each_new_xid(
    tmp_path: Path,
) -> None:
    """A real RunControl over LocalTransport, whose run_host runs the node's `journalctl`
    here (a script replaying the captured kernel log): the GPU pane shows the logged Xids as
    history, an Xid appended to the log is one toast and one red pane line, read again it is
    nothing new."""
    require_part(shutil.which("tmux") is not None, "tmux not installed")
    kernel_log = tmp_path / "kernel.log"
    kernel_log.write_text((FIXTURES / "journalctl-xid.txt").read_text())
    bin_dir = _fake_tools(tmp_path, kernel_log)
    (tmp_path / "tmux").mkdir()
    transport = LocalTransport(
        env={"PATH": f"{bin_dir}:{os.environ['PATH']}", "TMUX_TMPDIR": str(tmp_path / "tmux")}
    )
    host = local_host("gpu-node", tmp_path / "wd", python=sys.executable, session="t-xid")
    (tmp_path / "wd").mkdir()
    app = Recording([HostBinding("gpu-node", RunControl(transport, host), close=transport.close)])

    def xids() -> tuple[Any, ...]:
        return app.states["gpu-node"].xids

    async with app.run_test(size=(120, 40)) as pilot:
        await _until(pilot, lambda: len(xids()) == 3)
        assert all(s.history for s in xids()) and not any("Xid" in t for _, t in app.toasts)
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen) and app.screen.painted)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S+0000", time.gmtime())
        with kernel_log.open("a") as fh:
            fh.write(
                f"{stamp} gpu-node-1 kernel: NVRM: Xid (PCI:0000:9a:00): 79, pid=41233,"
                " name=python, GPU has fallen off the bus.\n"
            )
        follower = app.followers["gpu-node"]
        await follower.poll_gpus()  # the next GPU poll (the follower's own runs every 10 s)
        await follower.poll_gpus()  # and the one after: the same lines, nothing new
        await _until(pilot, lambda: len(xids()) == 4)
        new = xids()[-1]
        assert new.xid.code == 79 and not new.history
        said = [t for _, t in app.toasts if "Xid" in t]
        assert said == [
            "gpu-node: GPU 0: Xid 79 (GPU has fallen off the bus), process python (pid 41233):"
            " GPU has fallen off the bus."
        ]
        pane = app.screen.query_one("#gpus", Static)
        heading = "kernel log Xids: 4 (1 new; 3 before this view, dim)"
        await _until(pilot, lambda: heading in _plain(pane))
        lines = _plain(pane).splitlines()
        at = lines.index(heading)
        assert lines[at + 1].startswith("Xid  79 GPU0 9a:00 ")
        assert lines[at + 1].endswith("s  GPU has fallen off the bus")
        assert lines[at + 2].startswith("Xid  13 GPU0 9a:00 ")
        spans = pane.content.spans if isinstance(pane.content, Text) else []
        red = {_plain(pane)[s.start : s.end] for s in spans if s.style == "red"}
        assert "GPU has fallen off the bus" in red  # news red; history dim


def _plain(pane: Static) -> str:
    content = pane.content
    return content.plain if isinstance(content, Text) else str(content)


async def test_one_kernel_log_reader_for_the_watch_and_the_follower(tmp_path: Path) -> None:
    """`dflashctl.gpus.xids.XidReader` over a real LocalTransport whose node runs a `journalctl`
    script: the first read is history, a later one only what the read before lacked; a failed
    read is one KernelLogError line and moves nothing on; a node without journalctl is asked
    once."""
    kernel_log = tmp_path / "kernel.log"
    kernel_log.write_text((FIXTURES / "journalctl-xid.txt").read_text())
    mode = tmp_path / "mode"
    mode.write_text("ok")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "journalctl"
    tool.write_text(
        "#!/bin/sh\n"
        f'case "$(cat {mode})" in\n'
        f"  ok) cat {kernel_log} ;;\n"
        "  denied) echo 'No journal files were opened due to insufficient permissions.' >&2;"
        " exit 1 ;;\n"
        "  slow) sleep 5 ;;\n"
        "esac\n"
    )
    tool.chmod(0o755)
    node = LocalTransport(env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    reader = XidReader()
    first = await reader.read(node, timeout=budget.left())
    assert first is not None and first.history
    assert [x.code for x in first.fresh] == [94, 119, 13]
    again = await reader.read(node, timeout=budget.left())
    assert again == XidRead((), history=False)  # the same window again: nothing new
    with kernel_log.open("a") as fh:
        fh.write(
            "2026-11-30T04:00:01+0000 gpu-node-1 kernel: NVRM: Xid (PCI:0000:9a:00): 79,"
            " pid=41233, name=python, GPU has fallen off the bus.\n"
        )
    mode.write_text("denied")
    with pytest.raises(KernelLogError, match=r"^journalctl: No journal files were opened"):
        await reader.read(node, timeout=budget.left())
    mode.write_text("slow")
    with pytest.raises(KernelLogError, match=r"^kernel log query failed: .*no answer within"):
        await reader.read(node, timeout=0.5)
    mode.write_text("ok")
    news = await reader.read(
        node, timeout=budget.left()
    )  # against the last good read: the new line
    assert news is not None and not news.history and [x.code for x in news.fresh] == [79]

    bare = XidReader()
    no_journal = LocalTransport(env={"PATH": str(tmp_path / "empty")})
    assert await bare.read(no_journal, timeout=budget.left()) is None and not bare.available
    assert await bare.read(node, timeout=budget.left()) is None  # asked once: not asked again
