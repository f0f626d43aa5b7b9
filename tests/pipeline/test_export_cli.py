"""Exports: a run ended by `[schedule] max_steps` exports like a finished plan, and
`python -m trainer.export` writes the same files from any checkpoint (real tiny CPU runs)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests import budget
from trainer.model.export import read_drafter_config

from .conftest import REPO, RunCli, cli_env, write_config

FILES = ("config.json", "model.safetensors", "dflash.py")


def _export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.export", *args],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )


def _digests(directory: Path) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in FILES}


@pytest.mark.timeout(300)
def test_max_steps_exports_and_any_checkpoint_exports_the_same_files(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    run = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": 12},
        checkpoint={"every_steps": 6, "keep_last": 3},
    )
    done = run_cli(cfg, run)
    assert done.returncode == 0, done.stderr[-3000:]
    state = json.loads((run / "run-state.json").read_text())
    assert state["state"] == "finished" and state["end_step"] == 12 < state["total_steps"]
    # the end the user asked for exports both forms, as the plan's end does
    for form in ("export", "export-bf16"):
        assert all((run / form / name).is_file() for name in FILES), form
    assert json.loads((run / "export-bf16" / "config.json").read_text())["dtype"] == "bfloat16"

    # `latest` is the step-12 checkpoint: byte for byte the run's own export, both forms
    latest = _export("--checkpoint", "latest", "--run-dir", str(run), "--out", str(tmp_path / "x"))
    assert latest.returncode == 0, latest.stderr
    assert f"Exported step 12 ({run / 'checkpoints' / 'step-00000012.pt'})" in latest.stdout
    assert _digests(tmp_path / "x") == _digests(run / "export")
    assert _digests(tmp_path / "x-bf16") == _digests(run / "export-bf16")

    # a checkpoint named by path: its own (earlier) weights, loadable, in both dtypes
    mid = run / "checkpoints" / "step-00000006.pt"
    earlier = _export("--checkpoint", str(mid), "--out", str(tmp_path / "y"))
    assert earlier.returncode == 0, earlier.stderr
    assert read_drafter_config(tmp_path / "y") == read_drafter_config(run / "export")
    y, x = load_file(tmp_path / "y" / "model.safetensors"), load_file(run / "export" / FILES[1])
    assert y.keys() == x.keys() and any(not torch.equal(y[k], x[k]) for k in y)
    y16 = load_file(tmp_path / "y-bf16" / "model.safetensors")
    assert all(torch.equal(y16[k], y[k].to(torch.bfloat16)) for k in y)


def test_export_errors_are_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    full = tmp_path / "full"
    full.mkdir()
    (full / "keep.txt").write_text("mine")
    cases = [
        (
            ["--checkpoint", "best", "--out", str(tmp_path / "o")],
            "--checkpoint best needs --run-dir",
        ),
        (
            ["--checkpoint", "latest", "--run-dir", str(run), "--out", str(tmp_path / "o")],
            f"{run / 'checkpoints'}: no checkpoint",
        ),
        (
            ["--checkpoint", "best", "--run-dir", str(run), "--out", str(tmp_path / "o")],
            "best.pt: no best checkpoint",
        ),
        (
            ["--checkpoint", str(tmp_path / "nope.pt"), "--out", str(tmp_path / "o")],
            "nope.pt: no such file",
        ),
        (
            ["--checkpoint", "latest", "--run-dir", str(run), "--out", str(full)],
            f"{full}: exists and is not empty (--force writes into it)",
        ),
    ]
    bad = tmp_path / "bad.pt"
    bad.write_bytes(b"not a checkpoint")
    cases.append((["--checkpoint", str(bad), "--out", str(tmp_path / "o")], "bad.pt: cannot load"))
    for argv, message in cases:
        done = _export(*argv)
        assert done.returncode == 2, (argv, done.stderr)
        err = done.stderr.strip()
        assert message in err and err.count("\n") == 0, err
    assert (full / "keep.txt").read_text() == "mine"
