"""The one-sample overfit gate on the bundled tiny CPU config: it passes, and it fails naming
the stage with a broken mask rule (a block shown the context at its own anchor) and with a
corrupted export field (the layer ids written one off, the HF/engine convention slip)."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from torch import Tensor

from tests.conftest import REPO
from tests.serving.engine import python_env
from trainer.config.overlay import dump_toml, merge
from trainer.gate import cli
from trainer.model import attention
from trainer.model import export as export_module
from trainer.model.masks import dense_dflash_mask


@pytest.fixture(scope="module")
def tiny_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """configs/tiny-cpu.toml with its target and store built under a temp dir (once)."""
    work = tmp_path_factory.mktemp("gate-tiny")
    base = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    table = merge(
        base,
        {
            "data": {"store": str(work / "store"), "synthetic": {"rows": 64}},
            "model": {"target_dir": str(work / "tiny-qwen3")},
        },
    )
    path = work / "run.toml"
    path.write_text(dump_toml(table))
    return path


def run_cli(config: Path, out: Path) -> tuple[int, dict[str, Any]]:
    """The gate in this process (so a test can break a part first): exit status and JSON."""
    code = cli.main(["--config", str(config), "--out", str(out), "--json", str(out / "gate.json")])
    return code, json.loads((out / "gate.json").read_text())


def test_the_gate_passes_on_the_tiny_config(tiny_config: Path, tmp_path: Path) -> None:
    """`python -m trainer.gate` as a user runs it: every stage, tau >= 0.9 x block size."""
    argv = [sys.executable, "-m", "trainer.gate", "--config", str(tiny_config)]
    argv += ["--out", str(tmp_path), "--json", str(tmp_path / "gate.json")]
    done = subprocess.run(argv, cwd=REPO, env=python_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gate.json").read_text())
    assert result["passed"] and result["failure"] is None
    assert [s["stage"] for s in result["stages"]] == [
        "setup",
        "capture",
        "masks",
        "train",
        "decode",
        "export",
    ]
    assert all(s["ok"] for s in result["stages"])
    assert result["own_tau"] >= 0.9 * result["block_size"] == result["threshold"]
    assert "gate PASSED" in done.stdout and "own loop tau" in done.stdout
    assert (tmp_path / "export" / "config.json").is_file()
    prompt = json.loads((tmp_path / "prompts.jsonl").read_text().splitlines()[0])["input_ids"]
    assert prompt and all(isinstance(i, int) for i in prompt)


def test_a_broken_mask_rule_fails_at_masks(
    tiny_config: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The off-by-one leak: each block also sees the context at its anchor (j <= a)."""

    def leaky(anchors: Tensor, valid: Tensor, block: int, start: Tensor | None = None) -> Tensor:
        return dense_dflash_mask(anchors + 1, valid, block, start)

    monkeypatch.setattr(attention, "dense_dflash_mask", leaky)
    code, result = run_cli(tiny_config, tmp_path)
    err = capsys.readouterr().err
    assert code == 1 and not result["passed"]
    assert (
        "gate FAILED at stage masks: the training forward differs from the decoding forward" in err
    )
    assert [(s["stage"], s["ok"]) for s in result["stages"]] == [
        ("setup", True),
        ("capture", True),
        ("masks", False),
    ]


def test_a_corrupted_export_field_fails_at_export(
    tiny_config: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An exporter that writes the layer ids one off (the engines' capture convention)."""
    honest = export_module.drafter_config_json

    def shifted(cfg: Any, dtype: Any) -> dict[str, Any]:
        data = honest(cfg, dtype)
        ids = data["dflash_config"]["target_layer_ids"]
        data["dflash_config"]["target_layer_ids"] = [i + 1 for i in ids]
        return data

    monkeypatch.setattr(export_module, "drafter_config_json", shifted)
    code, result = run_cli(tiny_config, tmp_path)
    err = capsys.readouterr().err
    assert code == 1 and result["own_tau"] >= result["threshold"]  # trained fine; export broke
    assert (
        f"gate FAILED at stage export: {tmp_path / 'export' / 'config.json'}: "
        "dflash_config.target_layer_ids is [2, 6], the run used [1, 5]"
    ) in err
    assert [s["stage"] for s in result["stages"] if not s["ok"]] == ["export"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--engine", "vllm"], "--engine needs exactly one of --server URL or --serve-cmd CMD"),
        (
            ["--server", "http://127.0.0.1:1"],
            "--server, --serve-cmd and --serve-arg need --engine vllm",
        ),
    ],
)
def test_usage_errors_are_one_line_before_anything_loads(
    tiny_config: Path,
    tmp_path: Path,
    extra: list[str],
    message: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert cli.main(["--config", str(tiny_config), "--out", str(tmp_path), *extra]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
