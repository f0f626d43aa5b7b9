"""The served evaluation against a real vLLM (CPU build): the engine's own counters equal the
project's loop, turn by turn, and both commit identical tokens. First with the gate's overfit
drafter, on the memorised sample (both accept nearly the whole block) and on gsm8k questions
through the real chat template (where it accepts nothing); then with a drafter distilled from
its target (tests/serving/distilled.py), on prompts it never saw (where it accepts most of a
block, less at later positions)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import REPO
from tests.serving.distilled import HELD_OUT, DistilledRun
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


def assert_every_turn_agrees(result: dict[str, Any]) -> None:
    """Each turn: the engine committed our loop's tokens, and its drafts and accepted tokens
    are our loop's verify steps and accepted drafts."""
    for own, turn in zip(result["prompts"], result["served"]["turns"], strict=True):
        assert turn["tokens"] == own["tokens"] and turn["tokens_match"]
        assert turn["counters"]["drafts"] == own["verify_steps"]
        assert turn["counters"]["accepted"] == sum(own["accept_lengths"]) - own["verify_steps"]


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
    assert_every_turn_agrees(result)
    summary = served["summary"]
    assert summary["served"]["acceptance_per_position"] == summary["own"]["acceptance_per_position"]
    assert "all sets: vllm 0.32.0 tau=" in done.stdout and "all sets: own loop" in done.stdout
    assert "served/own tau 1.000; tokens identical in 3/3 turns; agree" in done.stdout


def test_a_drafter_distilled_from_its_target_accepts_alike_in_vllm_on_prompts_it_never_saw(
    distilled_server: RunningEngine,
    bigram_target_dir: Path,
    distilled_run: DistilledRun,
    tmp_path: Path,
) -> None:
    """Trained on the target's own greedy continuations, the drafter accepts on new prompts, in
    both loops alike: tau, every position's acceptance (measured 0.90, 0.79, 0.79), the tokens,
    each turn's counters."""
    out = tmp_path / "distilled.json"
    done = served_eval(
        bigram_target_dir, distilled_run.export, distilled_server.url, out, distilled_run.prompts
    )
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads(out.read_text())
    served = result["served"]
    summary = served["summary"]
    own, engine = summary["own"], summary["served"]
    print(f"distilled drafter: own tau {own['tau']:.3f}, served tau {engine['tau']:.3f}, "
          f"per position own {own['acceptance_per_position']}, "
          f"served {engine['acceptance_per_position']}")  # fmt: skip
    assert own["tau"] >= 2.0, own  # it really accepts: most of a block of 4 on unseen prompts
    per_position = own["acceptance_per_position"]
    assert len(per_position) == BLOCK_SIZE - 1 and all(p > 0 for p in per_position), per_position
    assert engine["acceptance_per_position"] == per_position
    assert engine["tau"] == own["tau"] and summary["agree"]
    assert summary["tokens_match"] == len(served["turns"]) == HELD_OUT
    assert_every_turn_agrees(result)
