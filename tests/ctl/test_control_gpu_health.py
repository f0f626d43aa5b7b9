"""RunControl.gpu_health: ECC counts and throttle reasons for the TUI's GPU pane, from a real
shell running an nvidia-smi that replays captured outputs (issue 12, item 6)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from dflashctl.config.inventory import local_host
from dflashctl.gpus.reader import GpuReadError
from dflashctl.monitor.follower import HealthSource
from dflashctl.remote import LocalTransport
from dflashctl.runs.control import RunControl

FIX = Path(__file__).parent / "fixtures" / "gpu-health"


def control_with(tmp_path: Path, script: str | None) -> tuple[RunControl, Path]:
    """A RunControl over a local shell whose PATH has `script` as nvidia-smi (None: none)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    if script is not None:
        tool = bin_dir / "nvidia-smi"
        tool.write_text(f'#!/bin/sh\necho "$*" >> {calls}\n{script}')
        tool.chmod(0o755)
    (tmp_path / "wd").mkdir()
    host = local_host("gpu-node", tmp_path / "wd", python=sys.executable, session="dflt-gpu-h")
    path = f"{bin_dir}:{os.environ['PATH']}" if script is not None else str(bin_dir)
    return RunControl(LocalTransport(env={"PATH": path}), host), calls


async def test_a_current_driver_reports_ecc_and_throttle_reasons(tmp_path: Path) -> None:
    ctl, calls = control_with(tmp_path, f"cat {FIX / 'h100x8-driver550.csv'}\n")
    assert isinstance(ctl, HealthSource)  # the TUI's follower polls it beside gpus()
    healths = await ctl.gpu_health()
    assert [h.index for h in healths] == list(range(8))
    assert healths[2].ecc_corrected_volatile == 2 and healths[0].reasons == frozenset()
    assert healths[1].reasons  # 0x...04: a clock-event reason is active
    assert len(calls.read_text().splitlines()) == 1


async def test_a_pre_535_driver_is_asked_again_with_its_field_names_once(tmp_path: Path) -> None:
    refuse = (
        f'case "$*" in *clocks_event_reasons*) cat {FIX / "driver470-unknown-field.stderr"} >&2;'
        " exit 2;; esac\n"
    )
    ctl, calls = control_with(tmp_path, refuse + f"cat {FIX / 'a100x2-driver470-legacy.csv'}\n")
    first = await ctl.gpu_health()
    second = await ctl.gpu_health()
    assert [h.index for h in first] == [0, 1] and first == second
    asked = calls.read_text().splitlines()
    assert len(asked) == 3  # refused once, then the legacy names, remembered for the next poll
    assert "clocks_event_reasons" in asked[0] and "clocks_throttle_reasons" in asked[2]


async def test_no_nvidia_smi_is_no_gpus_and_a_failing_one_is_one_line(tmp_path: Path) -> None:
    (tmp_path / "none").mkdir()
    absent, _ = control_with(tmp_path / "none", None)
    assert await absent.gpu_health() == []
    broken, _ = control_with(tmp_path, "echo 'Failed to initialize NVML: mismatch' >&2\nexit 9\n")
    with pytest.raises(GpuReadError) as err:
        await broken.gpu_health()
    assert "gpu-node: nvidia-smi" in str(err.value) and "\n" not in str(err.value)
