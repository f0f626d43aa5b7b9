"""The memory estimate per device as the Stager lays packets out (issue 16 item 4): a drafter
device holds two packets (the one in use and the one pulled ahead), the waiting ones sit on the
target devices (up to topology.hidden_depth each); and the M:N example config fits 96 GB."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from dflashctl.config.runconfig import drafter_device_count
from tests import budget
from trainer.config import TrainConfig
from trainer.memory.batches import batch_shapes
from trainer.memory.estimate import Estimator, precision_for, report
from trainer.memory.shapes import drafter_shape, read_target_shape

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ROOT / "tests" / "fixtures" / "qwen3-8b" / "config.json"
SEED = ROOT / "configs" / "qwen3-8b-6x1.toml"
M_N = ROOT / "configs" / "qwen3-8b-2x6.toml"
GB96 = 96 * 10**9
RESERVE = int(1.5 * 2**30)


def _report(path: Path) -> tuple[Estimator, dict[str, Any]]:
    cfg = TrainConfig.load(path)
    target = read_target_shape(QWEN3_8B)
    est = Estimator(cfg, target, drafter_shape(cfg, target), batch_shapes(cfg), precision_for(cfg))
    return est, report(est, GB96, RESERVE)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("path", [SEED, M_N], ids=["6x1", "2x6"])
def test_two_packets_on_each_drafter_and_the_waiting_ones_on_each_target(path: Path) -> None:
    est, rep = _report(path)
    topo = est.cfg.topology
    worst = max(est.packet_bytes(s) for s in est.shapes.batches)
    peak, plan = est.drafter_peak(est.cfg.model.max_query_rows)
    devices = {d["device"]: d for d in rep["devices"]}
    assert set(devices) == {*topo.target_devices, *topo.drafter_devices}
    for dev in topo.drafter_devices:
        d = devices[dev]
        assert d["roles"] == ["drafter"]
        assert d["items"]["staged_packets"] == worst  # one ahead; the one in use is the plan's
        assert plan.packet <= worst and d["peak"] == peak
    captured = est.target_device()["captured_features"]
    for dev in topo.target_devices:
        d = devices[dev]
        assert d["roles"] == ["target"]
        assert d["items"]["target_waiting_packets"] == topo.hidden_depth * captured
        assert d["peak"] == sum(d["items"].values()) and d["fits"]
    assert rep["fits"]


@pytest.mark.timeout(300)
def test_the_m_n_example_config_fits_96_gb_and_launches_drafters_plus_targets() -> None:
    """configs/qwen3-8b-2x6.toml: 2 target ranks serving 6 drafter ranks on one 8-GPU node,
    every GPU once; `python -m trainer.memory` on it says it fits 96 GB (exit 0), with its
    budget under the largest one that fits; dflashctl launches 8 processes for it."""
    cfg = TrainConfig.load(M_N)
    topo = cfg.topology
    assert topo.targets == "shared" and (len(topo.target_devices), len(topo.drafter_devices)) == (
        2,
        6,
    )
    assert sorted(topo.target_devices + topo.drafter_devices) == [f"cuda:{i}" for i in range(8)]
    assert drafter_device_count(M_N.read_text()) == 8
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.memory",
            "--config",
            str(M_N),
            "--device-memory",
            "96GB",
            "--target-config",
            str(QWEN3_8B),
            "--json",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=budget.left(),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr
    rep = json.loads(proc.stdout)
    assert rep["fits"] and all(d["fits"] for d in rep["devices"]) and len(rep["devices"]) == 8
    largest = rep["drafter"]["largest_max_query_rows"]
    assert cfg.model.max_query_rows is not None and cfg.model.max_query_rows < largest
    assert rep["drafter"]["configured"]["peak"] < 0.85 * rep["available"]
