"""Shared fixtures for the pipeline's end-to-end tests: one tiny store + target per session."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any, Protocol

import pytest

from tests import budget
from trainer.config.overlay import dump_toml, merge

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"


@pytest.fixture(scope="session")
def tiny_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The bundled tiny config with its store and target built once, at absolute paths."""
    from trainer.config import TrainConfig
    from trainer.pipeline import assets

    root = tmp_path_factory.mktemp("tiny-assets")
    raw = tomllib.loads(TINY.read_text())
    raw = merge(
        raw,
        {
            "data": {"store": str(root / "store"), "synthetic": {"rows": 1200}},
            "model": {"target_dir": str(root / "target")},
            "batching": {"token_budget": 512, "max_batch": 8},
            "status": {"interval_s": 0.5, "rate_window_s": 5.0},
            "checkpoint": {"every_steps": 1000, "every_minutes": 60.0, "keep_last": 3},
        },
    )
    cfg = TrainConfig.from_dict(raw)
    assets.ensure_store(cfg)
    assets.ensure_target(cfg)
    return raw


class RunCli(Protocol):
    """The trainer CLI on `config` into `run_dir` (the `run_cli` fixture): typed, so that a
    test passing what it no longer takes (a per-call timeout) fails the type check."""

    def __call__(
        self, config: Path, run_dir: Path, *args: str, env: dict[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]: ...


def cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", **extra})
    return env


def torchrun_argv(nproc: int, *program: str) -> list[str]:
    """`torchrun --standalone --nproc-per-node NPROC PROGRAM...`: one node's ranks here."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        *program,
    ]


def ranks_env(**extra: str) -> dict[str, str]:
    """`cli_env` for a torchrun launch: WORLD_SIZE is torchrun's to set."""
    env = cli_env(**extra)
    env.pop("WORLD_SIZE", None)
    return env


def run_rank_script(script: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A test's own Python script as two ranks under torchrun (standalone rendezvous)."""
    return subprocess.run(
        torchrun_argv(2, str(script), *args),
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )


def run_ranks(
    config: Path, run_dir: Path, nproc: int, **env: str
) -> subprocess.CompletedProcess[str]:
    """The trainer as `nproc` CPU processes under torchrun (standalone rendezvous)."""
    return subprocess.run(
        torchrun_argv(nproc, *trainer_argv(config, run_dir)[1:]),
        cwd=REPO,
        env=ranks_env(**env),
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )


def start_ranks(config: Path, run_dir: Path, nproc: int, **env: str) -> subprocess.Popen[str]:
    """`run_ranks` without waiting: the torchrun process, its output piped."""
    return subprocess.Popen(
        torchrun_argv(nproc, *trainer_argv(config, run_dir)[1:]),
        cwd=REPO,
        env=ranks_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def run_two_ranks(config: Path, run_dir: Path) -> subprocess.CompletedProcess[str]:
    """The trainer as two CPU ranks under torchrun (standalone rendezvous), as a node runs it."""
    return run_ranks(config, run_dir, 2)


def write_config(path: Path, base: dict[str, Any], **over: Any) -> Path:
    path.write_text(dump_toml(merge(base, over)))
    return path


def trainer_argv(config: Path, run_dir: Path, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trainer",
        "--config",
        str(config),
        "--run-dir",
        str(run_dir),
        *args,
    ]


@pytest.fixture
def run_cli() -> RunCli:
    def run(
        config: Path,
        run_dir: Path,
        *args: str,
        env: dict[str, str] | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """The trainer CLI, waited for within the test's one budget."""
        return subprocess.run(
            trainer_argv(config, run_dir, *args),
            cwd=REPO,
            env=env or cli_env(),
            capture_output=True,
            text=True,
            timeout=budget.left(),
        )

    return run
