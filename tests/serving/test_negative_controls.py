"""Negative controls: a real vLLM serving an export it reads unlike the training (layer ids one
off, another mask token, an anchor-first drafter) while the project's loop runs the drafter as
trained. Served acceptance falls (the mask token and the anchor layout collapse it to ~1 token
per step; the layer shift costs ~40 %: the memorised drafter keys mostly on the anchor token),
both loops still commit identical tokens (greedy verification), and `trainer.eval --engine
vllm` says so: exit 1, one line naming what differs.
Last, an engine that goes away mid-run: one line naming its URL, the turns done kept.

The three engines start together (one budget) and serve this module only."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.serving.broken_exports import anchor_first, layer_ids_shifted, mask_token_changed
from tests.serving.engine import (
    BLOCK_SIZE,
    START_BUDGET_S,
    GateRun,
    start_serving,
)
from tests.serving.test_served_eval import GSM8K, served_eval
from trainer import eval as eval_cli
from trainer.serving.compare import ServedTurn
from trainer.serving.errors import EngineError
from trainer.serving.launch import RunningEngine, stop, wait_healthy
from trainer.serving.served_eval import ServedSession

# The session's engine and this module's start within the first test: one budget for it all.
pytestmark = pytest.mark.timeout(1800)
PAD_ID = 151_643  # <|endoftext|>: a mask token an exporter might wrongly default to


@pytest.fixture(scope="module")
def broken_servers(
    vllm_python: Path,
    served_target_dir: Path,
    gate_run: GateRun,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[dict[str, RunningEngine]]:
    work = tmp_path_factory.mktemp("broken")
    exports = {
        "layer ids - 1": layer_ids_shifted(gate_run.export, work / "layers", -1),
        "mask token": mask_token_changed(gate_run.export, work / "mask", PAD_ID),
        "anchor-first": anchor_first(gate_run, served_target_dir, work / "anchor-first"),
    }
    engines: dict[str, RunningEngine] = {}
    try:
        for name, export in exports.items():
            log = work / f"{export.name}.log"
            engines[name] = start_serving(vllm_python, served_target_dir, export, log)
        deadline = time.monotonic() + START_BUDGET_S
        for engine in engines.values():
            wait_healthy(engine, max(1.0, deadline - time.monotonic()))
    except EngineError as err:
        for engine in engines.values():
            stop(engine.process)
        from tests.conftest import require_part

        require_part(False, f"vLLM did not start: {err}")
    try:
        yield engines
    finally:
        for engine in engines.values():
            stop(engine.process)


@pytest.mark.parametrize(
    ("fault", "collapses"), [("layer ids - 1", False), ("mask token", True), ("anchor-first", True)]
)
def test_served_acceptance_collapses_and_the_evaluation_says_so(
    broken_servers: dict[str, RunningEngine],
    served_target_dir: Path,
    gate_run: GateRun,
    tmp_path: Path,
    fault: str,
    collapses: bool,
) -> None:
    out = tmp_path / "served.json"
    url = broken_servers[fault].url
    done = served_eval(served_target_dir, gate_run.export, url, out, gate_run.prompts)
    assert done.returncode == 1, done.stdout + done.stderr
    result = json.loads(out.read_text())
    summary = result["served"]["summary"]
    own, served = summary["own"], summary["served"]
    assert own["tau"] >= 0.9 * BLOCK_SIZE  # the drafter as trained accepts its sample
    assert served["tau"] < (0.5 if collapses else 1.0) * own["tau"]
    assert summary["tokens_match"] == summary["turns"] == 1  # greedy verification: same tokens
    assert not summary["agree"]
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1
    assert "vllm 0.32.0 acceptance differs from the project's loop beyond tolerance" in errors[0]
    assert "accepted" in errors[0] and "served vs" in errors[0] and "docs/serving.md" in errors[0]


def test_an_engine_that_goes_away_mid_run_is_one_line_and_keeps_the_turns_done(
    broken_servers: dict[str, RunningEngine],
    served_target_dir: Path,
    gate_run: GateRun,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The engine is killed right after the first of three turns (it runs last in this module:
    the killed engine serves no later test)."""
    engine = broken_servers["anchor-first"]
    served_turn = ServedSession.turn

    def then_kill(self: ServedSession, ids: list[int], own: eval_cli.PromptResult) -> ServedTurn:
        result = served_turn(self, ids, own)
        os.killpg(engine.process.pid, signal.SIGKILL)
        engine.process.wait()
        return result

    monkeypatch.setattr(ServedSession, "turn", then_kill)
    out = tmp_path / "partial.json"
    argv = ["--target", str(served_target_dir), "--drafter", str(gate_run.export), "--prompts"]
    argv += [str(gate_run.prompts), str(GSM8K), "--max-new-tokens", "8", "--device", "cpu"]
    argv += ["--engine", "vllm", "--server", engine.url, "--no-greedy-check", "--json", str(out)]
    assert eval_cli.main(argv) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert errors[0].startswith(f"error: {engine.url}: the engine went away (")
    result = json.loads(out.read_text())
    assert result["partial"] and result["turns_planned"] == 3
    assert len(result["served"]["turns"]) == 1 and len(result["prompts"]) == 2
    assert result["served"]["summary"]["turns"] == 1
