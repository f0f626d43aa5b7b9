"""A drafter distilled from its target, served by vLLM: the session fixtures behind the served
evaluation on prompts the drafter never saw (issue 28: "a drafter that really accepts").

- `bigram_target_dir`: the bigram target (tests/serving/bigram_target.py).
- `distilled_run`: the target's own greedy continuations of `TRAIN_ROWS` random prompts (made
  by transformers' `generate` on the saved target, checked against the wiring), written as a
  token store (prompt unsupervised, continuation supervised), and `python -m trainer` trained
  on it for `TRAIN_STEPS` steps with `[schedule] max_steps`, which exports the drafter at its
  end; plus `HELD_OUT` new prompts as an eval prompt file.
- `distilled_server`: vLLM serving the bigram target with DFlash from that export.

Trained briefly (60 steps, ~1 min of CPU) on purpose: the drafter accepts most of a block, less
at later positions (0.90, 0.79, 0.79 measured), so the engine's per-position counters are
compared where they are neither all 0 nor all 1. The target's layers are all zero, so every
captured layer holds the same state: a layer-id slip is caught by the gate drafter's negative
controls on the random target (test_negative_controls.py), not here.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.serving.engine import BLOCK_SIZE, MASK_ID, python_env, serving
from trainer.serving.launch import RunningEngine

PROMPT_TOKENS, RESPONSE_TOKENS = 16, 48
TRAIN_ROWS, TRAIN_STEPS, HELD_OUT = 128, 60, 8
TRAIN_SEED, HELD_OUT_SEED = 1, 2


@dataclass(frozen=True)
class DistilledRun:
    """A finished training run on the target's continuations: its export and held-out prompts."""

    config: Path
    run_dir: Path
    export: Path
    prompts: Path


def random_prompts(count: int, seed: int) -> np.ndarray:
    """[count, PROMPT_TOKENS] ids drawn from the target's alphabet."""
    from tests.serving.bigram_target import alphabet

    rng = np.random.default_rng(seed)
    return alphabet()[rng.integers(0, len(alphabet()), size=(count, PROMPT_TOKENS))]


def greedy_continuations(target_dir: Path, prompts: np.ndarray, new_tokens: int) -> np.ndarray:
    """The target's own greedy continuations (transformers, fp32, CPU), checked against the
    chain it was wired to say."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.serving.bigram_target import successors

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)
    model.train(False)
    parts = []
    for chunk in np.array_split(prompts, max(1, len(prompts) // 128)):  # [128, V] logits a step
        ids = torch.from_numpy(chunk.astype(np.int64))
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                do_sample=False,
            )
        parts.append(out[:, prompts.shape[1] :].numpy())
    said = np.concatenate(parts)
    nxt = successors()
    for row, prompt in zip(said, prompts, strict=True):
        expected, last = [], int(prompt[-1])
        for _ in range(new_tokens):
            last = nxt[last]
            expected.append(last)
        assert row.tolist() == expected, "the bigram target does not say its chain"
    return said


def write_store(out: Path, prompts: np.ndarray, replies: np.ndarray) -> None:
    from tests.serving.bigram_target import VOCAB
    from trainer.data.store import StoreWriter

    prompt_mask = np.zeros(prompts.shape[1], np.uint8)
    reply_mask = np.ones(replies.shape[1], np.uint8)
    with StoreWriter(out) as writer:
        for prompt, reply in zip(prompts, replies, strict=True):
            writer.add(np.concatenate([prompt, reply]), np.concatenate([prompt_mask, reply_mask]))
        writer.commit(
            kind="synthetic",
            source="the bigram target's greedy continuations (tests/serving/distilled.py)",
            source_sha256="0" * 64,
            vocab_size=VOCAB,
            max_length=int(prompts.shape[1] + replies.shape[1]),
            reserved_token_ids=[MASK_ID],
            mask_token_id=MASK_ID,
            mask_strategy="prompt mask 0, the target's continuation mask 1",
            params={"rows": len(prompts), "seed": TRAIN_SEED},
        )


def distilled_config(directory: Path, target_dir: Path, store: Path) -> Path:
    from trainer.config.overlay import dump_toml

    table = {
        "seed": 0,
        "data": {"store": str(store)},
        "batching": {"token_budget": 1024, "max_batch": 16, "num_buckets": 1},
        "model": {
            "target_dir": str(target_dir),
            "mask_token_id": MASK_ID,
            "num_anchors": 16,
            "drafter": {"num_layers": 1, "block_size": BLOCK_SIZE},
        },
        "topology": {"target_devices": ["cpu"], "drafter_devices": ["cpu"]},
        "optimizer": {"lr": 3e-3},
        "schedule": {"epochs": 100, "max_steps": TRAIN_STEPS, "warmup_ratio": 0.02},
        "status": {"interval_s": 5},
    }
    path = directory / "run.toml"
    path.write_text(dump_toml(table))
    return path


@pytest.fixture(scope="session")
def bigram_target_dir(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    from tests.serving.bigram_target import build_bigram_target

    out = tmp_path_factory.mktemp("bigram-target")
    return build_bigram_target(out, qwen3_tokenizer_dir, MASK_ID)


@pytest.fixture(scope="session")
def distilled_run(
    tmp_path_factory: pytest.TempPathFactory, bigram_target_dir: Path
) -> DistilledRun:
    work = tmp_path_factory.mktemp("distilled")
    prompts = random_prompts(TRAIN_ROWS, TRAIN_SEED)
    write_store(
        work / "store", prompts, greedy_continuations(bigram_target_dir, prompts, RESPONSE_TOKENS)
    )
    config = distilled_config(work, bigram_target_dir, work / "store")
    run_dir = work / "run"
    argv = [sys.executable, "-m", "trainer", "--config", str(config), "--run-dir", str(run_dir)]
    done = subprocess.run(argv, env=python_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    held_out = random_prompts(HELD_OUT, HELD_OUT_SEED)
    assert not {tuple(p) for p in held_out.tolist()} & {tuple(p) for p in prompts.tolist()}
    file = work / "held-out.jsonl"
    file.write_text("".join(json.dumps(p) + "\n" for p in held_out.tolist()))
    return DistilledRun(config, run_dir, run_dir / "export", file)


@pytest.fixture(scope="session")
def distilled_server(
    vllm_python: Path,
    bigram_target_dir: Path,
    distilled_run: DistilledRun,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[RunningEngine]:
    log = tmp_path_factory.mktemp("vllm-distilled-log") / "vllm.log"
    with serving(vllm_python, bigram_target_dir, distilled_run.export, log) as engine:
        yield engine
