"""benchmarks/gpu.sh's `measure` step (opt-in: GPU_SH_MEASURE=1) in its CPU smoke form: the
step runs `python -m trainer.measure` through gpu.sh's time box and records one line per
strategy and the step-cost fit in results.jsonl."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(400)
def test_the_measure_step_records_each_strategy_and_the_fit(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "GPU_SH_"))}
    env.update(OUT=str(tmp_path), GPU_SH_STEPS="measure", GPU_SH_MEASURE="1")
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh"), "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=390,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    steps = [json.loads(ln) for ln in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert [(s["step"], s["rc"], s["timed_out"]) for s in steps] == [("measure", 0, False)]
    recs = [json.loads(ln) for ln in (tmp_path / "results.jsonl").read_text().splitlines()]
    kinds = [r["kind"] for r in recs]
    assert kinds[0] == "start" and kinds[-1] == "done" and recs[-1]["ok"] is True
    by = {r["strategy"]: r for r in recs if r["kind"] == "strategy"}
    assert list(by) == ["sorted", "packed"]
    assert all(r["tokens_s"] > 0 and r["predicted_tokens_s"] > 0 for r in by.values())
    assert by["sorted"]["ratio_to_sorted"]["median"] == 1.0
    fit = next(r for r in recs if r["kind"] == "calibration")
    assert fit["points"] > 0 and all(v >= 0 for v in fit["coef"].values())


def test_without_the_opt_in_gpu_sh_skips_the_measure_step(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "GPU_SH_"))}
    env.update(OUT=str(tmp_path), GPU_SH_STEPS="measure")
    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu.sh"), "--smoke"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0
    assert not (tmp_path / "steps.jsonl").exists()
