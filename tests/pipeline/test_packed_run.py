"""strategy = "packed" through the real pipeline: `python -m trainer` on the tiny CPU config."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dflashctl.demo import DEMO_OVERLAY, REPO_CONFIG, demo_config_text
from trainer.buckets import sampler_for
from trainer.config import TrainConfig
from trainer.data.store import TokenStore
from trainer.events import ErrorEvent, RawLine, StatusEvent, parse_line
from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

from .conftest import RunCli, run_two_ranks, write_config

PACKED = {"strategy": "packed"}
DEMO_PACKED = {**PACKED, "row_length": 1024}  # configs/demo.toml's commented table


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _events(run_dir: Path) -> list[Any]:
    return [parse_line(x) for x in (run_dir / "status.log").read_text().splitlines()]


@pytest.mark.timeout(300)
def test_a_packed_run_trains_and_resumes_bit_for_bit(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """40 steps of packed batches end to end (status lines parse, no error); a resume from the
    step-20 checkpoint retrains 21..40 with the uninterrupted run's losses and weights; the
    batches are packed (several documents a row, under the budget) and the plan's real-token
    total is the data's."""
    whole = write_config(
        tmp_path / "whole.toml",
        tiny_assets,
        batching=PACKED,
        schedule={"max_steps": 40},
        checkpoint={"every_steps": 20},
    )
    a = run_cli(whole, tmp_path / "a")
    assert a.returncode == 0, a.stderr[-3000:]
    events = _events(tmp_path / "a")
    assert not [e for e in events if isinstance(e, RawLine | ErrorEvent)]
    status = [e for e in events if isinstance(e, StatusEvent)]
    assert status[-1].step == 40 and any(s.ktok_s and s.ktok_s > 0 for s in status)
    la = _losses(tmp_path / "a")
    assert sorted(la) == list(range(1, 41)) and all(np.isfinite(list(la.values())))

    mid = tmp_path / "a" / "checkpoints" / "step-00000020.pt"
    b = run_cli(whole, tmp_path / "b", "--resume", str(mid))
    assert b.returncode == 0, b.stderr[-3000:]
    lb = _losses(tmp_path / "b")
    assert sorted(lb) == list(range(21, 41))
    assert [lb[s] for s in range(21, 41)] == [la[s] for s in range(21, 41)]
    sa = load_checkpoint(list_checkpoints(tmp_path / "a")[-1][1])
    sb = load_checkpoint(list_checkpoints(tmp_path / "b")[-1][1])
    assert all((sa["drafter"][k] == sb["drafter"][k]).all() for k in sa["drafter"])
    assert sa["sampler"]["config"]["strategy"] == "packed"

    cfg = TrainConfig.load(whole)
    lengths = TokenStore.open(cfg.resolve(cfg.data.store)).lengths
    sampler = sampler_for(cfg.batching, np.asarray(lengths), seed=cfg.seed)
    batches = sampler.epoch_batches(0)
    assert sampler.row_length == int(lengths.max())
    assert max(len(b.indices) / b.num_rows for b in batches) > 2  # rows really hold several
    assert all(b.num_rows * int(lengths.max()) <= cfg.batching.token_budget for b in batches)
    assert sum(b.real_tokens for b in batches) == int(lengths.sum())


@pytest.mark.timeout(240)
def test_the_demo_config_switched_to_packed_validates_and_steps(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """`make demo` on packed = configs/demo.toml's commented [batching] table uncommented
    (strategy = "packed", row_length = 1024): the config the demo writes from it validates and
    trains, evaluating held-out rows."""
    uncommented = re.sub(
        r"(?m)^# (\[batching\]|strategy = |row_length = )", r"\1", DEMO_OVERLAY.read_text()
    )
    overlay = tomllib.loads(uncommented)
    assert overlay["batching"] == DEMO_PACKED
    cache = tmp_path / "cache"
    cache.mkdir()
    (cache / "tiny-store").symlink_to(tiny_assets["data"]["store"])
    (cache / "tiny-qwen3").symlink_to(tiny_assets["model"]["target_dir"])
    text = demo_config_text(tomllib.loads(REPO_CONFIG.read_text()), overlay, cache)
    assert 'strategy = "packed"' in text and "row_length = 1024" in text
    (tmp_path / "demo.toml").write_text(text)
    cfg = TrainConfig.load(tmp_path / "demo.toml")
    assert cfg.batching.strategy == "packed" and cfg.eval.holdout_rows > 0
    run = write_config(
        tmp_path / "run.toml",
        tomllib.loads(text),
        schedule={"max_steps": 8},
        eval={"every_steps": 4},
        status={"interval_s": 0.5},
    )
    out = run_cli(run, tmp_path / "run")
    assert out.returncode == 0, out.stderr[-3000:]
    losses = _losses(tmp_path / "run")
    assert sorted(losses) == list(range(1, 9))
    log = (tmp_path / "run" / "status.log").read_text()
    assert "Eval" in log and "ERROR" not in log


@pytest.mark.timeout(240)
def test_two_ranks_train_on_packed_shards(tmp_path: Path, tiny_assets: dict[str, Any]) -> None:
    """Two gloo ranks under torchrun: each takes its packed shard of every step (the sampler's
    row-splitting keeps step counts equal) and both step together to the end."""
    cfg = write_config(
        tmp_path / "dp.toml",
        tiny_assets,
        batching=PACKED,
        topology={"drafter_devices": ["cpu", "cpu"], "target_devices": ["cpu"]},
        schedule={"max_steps": 10},
    )
    out = run_two_ranks(cfg, tmp_path / "run")
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    losses = _losses(tmp_path / "run")
    assert sorted(losses) == list(range(1, 11)) and all(np.isfinite(list(losses.values())))
    state = load_checkpoint(list_checkpoints(tmp_path / "run")[-1][1])
    assert state["world_size"] == 2 and state["sampler"]["config"]["strategy"] == "packed"
