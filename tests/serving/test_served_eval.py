"""The served evaluation against a real vLLM (CPU build) serving the gate's overfit drafter:
the engine's own counters equal the project's loop, turn by turn, and both commit identical
tokens, on the memorised sample (both accept nearly the whole block) and on gsm8k questions
through the real chat template (where the drafter accepts little)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.serving.engine import BLOCK_SIZE, GATE_RESPONSE_TOKENS, GateRun, python_env
from trainer.serving.launch import RunningEngine

# The session's engine and this module's start within the first test: one budget for it all.
pytestmark = pytest.mark.timeout(1800)
GSM8K = REPO / "tests" / "fixtures" / "eval-prompts" / "gsm8k_test.jsonl"


def served_eval(
    target: Path, drafter: Path, url: str, out: Path, *prompts: Path
) -> subprocess.CompletedProcess[str]:
    argv = [
        sys.executable,
        "-m",
        "trainer.eval",
        "--target",
        str(target),
        "--drafter",
        str(drafter),
    ]
    argv += ["--prompts", *map(str, prompts), "--max-new-tokens", str(GATE_RESPONSE_TOKENS)]
    argv += ["--engine", "vllm", "--server", url, "--device", "cpu", "--no-greedy-check"]
    argv += ["--json", str(out)]
    return subprocess.run(argv, cwd=REPO, env=python_env(), capture_output=True, text=True)


def test_served_acceptance_equals_the_projects_loop(
    vllm_server: RunningEngine, served_target_dir: Path, gate_run: GateRun, tmp_path: Path
) -> None:
    out = tmp_path / "served.json"
    done = served_eval(
        served_target_dir, gate_run.export, vllm_server.url, out, gate_run.prompts, GSM8K
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    assert result["engine"]["name"] == "vllm" and result["engine"]["version"] == "0.32.0"
    assert result["engine"]["url"] == vllm_server.url and result["engine"]["argv"] is None
    served = result["served"]
    gate_set, gsm8k = served["sets"]
    # The memorised sample: both loops accept nearly the whole block, and the same.
    assert gate_set["own"]["tau"] >= 0.9 * BLOCK_SIZE
    assert gate_set["served"] == gate_set["own"]
    # Every turn: identical tokens, identical counters (tau, per-position acceptance).
    assert served["summary"]["agree"] and served["summary"]["tokens_match"] == 3 == len(
        served["turns"]
    )
    assert gsm8k["served"]["verify_steps"] > 0
    for own, turn in zip(result["prompts"], served["turns"], strict=True):
        assert turn["tokens"] == own["tokens"] and turn["tokens_match"]
        assert turn["counters"]["drafts"] == own["verify_steps"]
        assert turn["counters"]["accepted"] == sum(own["accept_lengths"]) - own["verify_steps"]
    summary = served["summary"]
    assert summary["served"]["acceptance_per_position"] == summary["own"]["acceptance_per_position"]
    assert "all sets: vllm 0.32.0 tau=" in done.stdout and "all sets: own loop" in done.stdout
    assert "served/own tau 1.000; tokens identical in 3/3 turns; agree" in done.stdout
