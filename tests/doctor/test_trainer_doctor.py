"""`python -m trainer.doctor --config RUN.toml` on the CPU, as CI runs it (issue 26, Deliver 3):
the stages that run on a CPU run for real, the CUDA stages are skipped by name with why, and a
device that fails exits 1 naming the failing stage (a config naming a CUDA device this machine
does not have)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests import budget
from trainer.config.overlay import dump_toml, merge

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"


def _config(tmp_path: Path, **over: Any) -> Path:
    raw = merge(tomllib.loads(TINY.read_text()), {"model": {"target_dir": str(tmp_path / "t")}})
    path = tmp_path / "run.toml"
    path.write_text(dump_toml(merge(raw, over)))
    return path


def _doctor(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.doctor", "--config", str(config), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )


@pytest.mark.timeout(180)
def test_cpu_config_runs_its_stages_and_skips_the_cuda_ones_by_name(tmp_path: Path) -> None:
    proc = _doctor(_config(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    by_stage = {ln.split()[1]: ln for ln in lines[1:-1]}
    assert list(by_stage) == ["alloc", "attention", "ce", "step", "copy", "nccl"]
    assert by_stage["alloc"].split()[2] == "ok" and "bf16 matmul" in by_stage["alloc"]
    assert by_stage["step"].split()[2] == "ok" and "one drafter step" in by_stage["step"]
    for stage in ("attention", "ce", "copy", "nccl"):
        assert by_stage[stage].split()[2] == "skipped", by_stage[stage]
        assert "CUDA stage" in by_stage[stage], by_stage[stage]
    assert lines[-1] == "doctor: ok (2 stages ran, 4 skipped)"

    js = json.loads(_doctor(_config(tmp_path), "--json").stdout)
    assert js["ok"] is True and js["failed"] == []
    assert [(s["device"], s["stage"], s["status"]) for s in js["stages"]] == [
        ("cpu", "alloc", "ok"),
        ("cpu", "attention", "skipped"),
        ("cpu", "ce", "skipped"),
        ("cpu", "step", "ok"),
        ("-", "copy", "skipped"),
        ("-", "nccl", "skipped"),
    ]


@pytest.mark.timeout(180)
def test_a_failing_device_exits_1_naming_the_stage(tmp_path: Path) -> None:
    """cuda:99 exists on no machine: its alloc fails with the reason, the CPU drafter's stages
    still run, and the summary and exit status name `cuda:99 alloc`."""
    config = _config(tmp_path, topology={"target_devices": ["cuda:99"]})
    proc = _doctor(config)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    alloc = next(ln for ln in lines if ln.startswith("cuda:99"))
    assert alloc.split()[1:3] == ["alloc", "fail"], alloc
    assert "torch.cuda.is_available() is false" in alloc or "CUDA device(s) visible" in alloc
    assert any(ln.split()[1:3] == ["step", "ok"] for ln in lines[1:-1])
    assert lines[-1].startswith("doctor: FAILED: cuda:99 alloc (")
