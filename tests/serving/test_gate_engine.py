"""The gate's engine stage on a real vLLM it starts itself (`--serve-cmd`): the overfit drafter
accepts nearly the whole block there too, equal to the project's loop, and the JSON records the
engine's exact command line and version."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.serving.engine import (
    BLOCK_SIZE,
    ENGINE_ARGS,
    ENGINE_ENV,
    GATE_RESPONSE_TOKENS,
    GateRun,
    python_env,
    serve_cmd,
)

pytestmark = pytest.mark.timeout(1800)  # a gate run and an engine start on a loaded machine


def test_the_gate_passes_in_the_engine_it_starts(
    vllm_python: Path, gate_run: GateRun, tmp_path: Path
) -> None:
    argv = [sys.executable, "-m", "trainer.gate", "--config", str(gate_run.config)]
    argv += ["--out", str(tmp_path), "--response-tokens", str(GATE_RESPONSE_TOKENS)]
    argv += ["--json", str(tmp_path / "gate.json"), "--engine", "vllm"]
    argv += [
        "--serve-cmd",
        " ".join(serve_cmd(vllm_python)),
        "--serve-log",
        str(tmp_path / "e.log"),
    ]
    argv += [f"--serve-arg={arg}" for arg in ENGINE_ARGS]
    env = {**python_env(), **ENGINE_ENV}
    done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((tmp_path / "gate.json").read_text())
    assert [s["stage"] for s in result["stages"]][-1] == "engine" and result["passed"]
    assert result["served_tau"] >= 0.9 * BLOCK_SIZE and result["served_tau"] == result["own_tau"]
    served = result["served"]
    assert served["version"] == "0.32.0" and result["engine"] == "vllm 0.32.0"
    spec = json.loads(served["argv"][served["argv"].index("--speculative-config") + 1])
    assert spec == {
        "method": "dflash",
        "model": str(tmp_path / "export"),
        "num_speculative_tokens": BLOCK_SIZE - 1,
    }
    assert served["argv"][: len(serve_cmd(vllm_python))] == serve_cmd(vllm_python)
    assert served["log"] == str(tmp_path / "e.log") and os.path.getsize(served["log"]) > 0
    tau, own = result["served_tau"], result["own_tau"]
    assert (
        f"gate engine: ok (vllm 0.32.0 tau {tau:.2f}, own {own:.2f}, tokens identical"
        in done.stdout
    )
