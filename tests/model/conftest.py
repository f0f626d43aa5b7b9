"""Shared fixtures: tiny random Qwen3 targets per test session (built, never downloaded)."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from trainer.model.target import TargetModel
from trainer.model.tiny import build_tiny_target


@pytest.fixture(scope="session", autouse=True)
def _one_thread() -> Iterator[None]:
    # 2 shared cores: one intra-op thread is ~10x faster than two under contention for
    # these tiny shapes (OpenMP threads spin-wait when oversubscribed).
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3"), seed=0)


@pytest.fixture(scope="session")
def target(tiny_dir: Path) -> TargetModel:
    return TargetModel.load(tiny_dir, [1, 5], device="cpu")


QWEN3_VOCAB = 151_936  # Qwen3's embedding rows (the tokenizer's ids end at 151,668)
QWEN3_EOS = [151645, 151643]  # <|im_end|>, <|endoftext|>: Qwen3-8B's generation_config


@pytest.fixture(scope="session")
def qwen3_target_dir(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Path:
    """A tiny random target with Qwen3's real vocabulary size, laid out like a downloaded
    Qwen3 checkpoint: the real tokenizer and a generation_config.json with Qwen3's EOS ids.

    Every id the real tokenizer produces is a row of its embedding, so real chat prompts run
    through it unmapped (~80 MB on disk, built in about a second).
    """
    out = build_tiny_target(tmp_path_factory.mktemp("tiny-qwen3-vocab"), vocab_size=QWEN3_VOCAB)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(qwen3_tokenizer_dir / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": QWEN3_EOS}) + "\n")
    return out


@pytest.fixture(scope="session")
def qwen3_target(qwen3_target_dir: Path) -> TargetModel:
    return TargetModel.load(qwen3_target_dir, [1, 5], device="cpu")
