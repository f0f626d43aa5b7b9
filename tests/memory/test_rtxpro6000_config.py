"""configs/rtxpro6000-8x.toml (issue 26, Deliver 5): the seed's 8x RTX PRO 6000 box. Its
topology fits every card and its `model.max_query_rows` is exactly the largest budget the
memory estimator picks for a 97,887 MiB card, as the recorded output next to it says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from trainer.config import TrainConfig
from trainer.memory.cli import run

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "configs" / "rtxpro6000-8x.toml"
RECORD = ROOT / "configs" / "rtxpro6000-8x.memory.txt"
QWEN3_8B = ROOT / "tests" / "fixtures" / "qwen3-8b" / "config.json"


@pytest.mark.timeout(300)
def test_the_budget_is_the_estimators_pick_and_every_card_fits() -> None:
    cfg = TrainConfig.load(CONFIG)
    assert cfg.topology.targets == "shared"
    devices = [*cfg.topology.target_devices, *cfg.topology.drafter_devices]
    assert sorted(devices) == [f"cuda:{i}" for i in range(8)]  # all eight cards, each once
    rep = run(CONFIG, 97887 * 2**20, int(1.5 * 2**30), QWEN3_8B)
    assert rep["fits"] and all(dev["fits"] for dev in rep["devices"])
    assert rep["drafter"]["largest_max_query_rows"] == cfg.model.max_query_rows == 56576
    recorded = RECORD.read_text()
    assert "--device-memory 97887MiB" in recorded.splitlines()[0]
    m = re.search(r"largest model\.max_query_rows that fits: ([\d,]+)", recorded)
    assert m and int(m.group(1).replace(",", "")) == cfg.model.max_query_rows
    assert recorded.rstrip().endswith("# exit status: 0")
