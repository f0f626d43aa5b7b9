"""Trackers under test never touch the network or $HOME: W&B is pinned offline into tmp dirs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import budget


@pytest.fixture(autouse=True)
def _wandb_sandbox(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    sandbox = tmp_path / "wandb-home"
    sandbox.mkdir()
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(sandbox))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(sandbox / "config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(sandbox / "cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(sandbox / "data"))
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # discard port: nothing answers
    monkeypatch.setenv("HOME", str(sandbox))


def wandb_records(run_file: Path) -> list[dict[str, Any]]:
    """The records of a ``.wandb`` transaction log, read by wandb's own reader (leet inspect)."""
    res = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(run_file)],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=budget.left(),
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines() if line.strip()]


def wandb_history(run_file: Path) -> dict[int, dict[str, float]]:
    """step -> the metrics logged at that step (wandb's own `_step`/`_runtime` keys dropped)."""
    out: dict[int, dict[str, float]] = {}
    for rec in wandb_records(run_file):
        if rec.get("type") == "history":
            item = rec["history"]["item"]
            out[int(item["_step"])] = {k: v for k, v in item.items() if not k.startswith("_")}
    return out


def wandb_run_files(run_dir: Path) -> list[Path]:
    """The run's ``.wandb`` logs, oldest first (one per process that opened the run)."""
    return sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
