"""`[model.loss]` in real CPU training runs on the tiny config: D-PACE with logit distillation
trains, says which loss ran on every status line, in its checkpoints and in TensorBoard, resumes
bit for bit, and a resume under another loss is refused naming the keys and both losses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.events import LOSS_TYPE_KEY, StatusEvent, parse_line
from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

from .conftest import RunCli, run_ranks, write_config

DPACE_KD = {"type": "dpace", "kd_weight": 0.5}
LABEL = "dpace(alpha:0.5)+kd(0.5)"


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _status(run_dir: Path) -> list[StatusEvent]:
    lines = (run_dir / "status.log").read_text().splitlines()
    return [e for e in map(parse_line, lines) if isinstance(e, StatusEvent)]


def _tb_text(tb_dir: Path, tag: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return [e.tensor_proto.string_val[0].decode() for e in acc.Tensors(f"{tag}/text_summary")]


def _config(tmp: Path, assets: dict[str, Any], name: str, steps: int, **loss: Any) -> Path:
    return write_config(
        tmp / name,
        assets,
        model={**assets["model"], "loss": loss},
        schedule={"max_steps": steps},
        checkpoint={**assets["checkpoint"], "every_steps": 6},
        tracking={"backends": ["tensorboard"]},
    )


@pytest.mark.timeout(600)
def test_dpace_with_distillation_trains_records_its_loss_resumes_and_refuses_another(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    whole_cfg = _config(tmp_path, tiny_assets, "whole.toml", 12, **DPACE_KD)
    whole = run_cli(whole_cfg, tmp_path / "whole")
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-3000:]
    straight = _losses(tmp_path / "whole")
    assert sorted(straight) == list(range(1, 13))

    run = tmp_path / "run"
    first = run_cli(_config(tmp_path, tiny_assets, "a.toml", 6, **DPACE_KD), run)
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-3000:]
    status = _status(run)
    assert status and all(s.extra.get(LOSS_TYPE_KEY) == LABEL for s in status)
    (step, path), *_ = list_checkpoints(run)[-1:]
    state = load_checkpoint(path)
    assert step == 6 and state["loss"] == LABEL
    assert state["config"]["model"]["loss"] == {"type": "dpace", "alpha": None, "kd_weight": 0.5}
    assert _tb_text(run / "tb", "run/loss") == [LABEL]

    # another loss: refused, naming the keys and both losses; nothing trained
    ce = run_cli(_config(tmp_path, tiny_assets, "ce.toml", 12), run)
    assert ce.returncode == 2, ce.stdout[-2000:]
    assert (
        f"cannot resume from {path}: changed model.loss.kd_weight, model.loss.type (the "
        f"checkpoint trained loss {LABEL}, this config ce); use --fresh" in ce.stdout
    ), ce.stdout[-2000:]
    assert list_checkpoints(run)[-1][0] == 6

    # the same loss: resumes and trains the uninterrupted run's losses
    again = run_cli(_config(tmp_path, tiny_assets, "b.toml", 12, **DPACE_KD), run)
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
    assert f"Resuming from checkpoint: step=6 path={path}" in again.stdout
    resumed = _losses(run)
    assert [resumed[s] for s in range(1, 13)] == [straight[s] for s in range(1, 13)]
    assert _tb_text(run / "tb", "run/loss") == [LABEL, LABEL]


@pytest.mark.timeout(600)
def test_a_target_rank_sends_the_last_hidden_state_for_distillation(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """topology.targets = "shared" (1 target rank : 1 drafter rank): the features travel with
    the last hidden state, and the drafter trains a single process's distilled losses."""
    loss = {"kd_weight": 0.5}
    single = write_config(
        tmp_path / "1.toml",
        tiny_assets,
        model={**tiny_assets["model"], "loss": loss},
        schedule={"max_steps": 8},
    )
    shared = write_config(
        tmp_path / "11.toml",
        tiny_assets,
        model={**tiny_assets["model"], "loss": loss},
        topology={"targets": "shared", "target_devices": ["cpu"], "drafter_devices": ["cpu"]},
        schedule={"max_steps": 8},
    )
    a = run_cli(single, tmp_path / "1")
    assert a.returncode == 0, a.stderr[-3000:]
    b = run_ranks(shared, tmp_path / "11", 2)
    assert b.returncode == 0, (b.stdout[-2000:], b.stderr[-3000:])
    assert _losses(tmp_path / "11") == _losses(tmp_path / "1")
    assert _status(tmp_path / "11")[-1].extra[LOSS_TYPE_KEY] == "ce+kd(0.5)"
