"""Shared fixtures: one tiny random Qwen3 target per test session (built, never downloaded)."""

from __future__ import annotations

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
