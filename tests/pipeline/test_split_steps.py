"""`model.max_query_rows`: a run whose packets are split into small micro-steps trains the same
drafter as the unbounded run (issue 16, item 1; the exactness of one split step is
tests/model/test_split_step.py)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

from .conftest import RunCli, write_config

STEPS = 20


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.timeout(240)
def test_split_steps_and_checkpointed_layers_give_the_unbounded_loss_sequence(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """Budget 24 query rows (6 blocks of 4; a packet has up to 8 rows x 8 anchors x 4 = 256,
    so every packet is cut, most rows into anchor runs): the same 20 losses to fp32 tolerance
    and the same final drafter. Checkpointed layers: the very same losses."""
    runs = {}
    variants: tuple[tuple[str, dict[str, Any]], ...] = (
        ("unbounded", {}),
        ("bounded", {"max_query_rows": 24}),
        (
            "checkpointed",
            {"drafter": {**tiny_assets["model"]["drafter"], "checkpoint_layers": True}},
        ),
    )
    for name, extra in variants:
        model = {**tiny_assets["model"], **extra}
        cfg = write_config(
            tmp_path / f"{name}.toml", tiny_assets, model=model, schedule={"max_steps": STEPS}
        )
        proc = run_cli(cfg, tmp_path / name)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = tmp_path / name
    # activation checkpointing recomputes the same ops: bit-equal on CPU
    assert _losses(runs["checkpointed"]) == _losses(runs["unbounded"])
    la, lb = _losses(runs["unbounded"]), _losses(runs["bounded"])
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    for s in la:
        assert math.isclose(la[s], lb[s], rel_tol=1e-5), (s, la[s], lb[s])
    sa = load_checkpoint(list_checkpoints(runs["unbounded"])[-1][1])
    sb = load_checkpoint(list_checkpoints(runs["bounded"])[-1][1])
    assert sb["config"]["model"]["max_query_rows"] == 24
    for k, a in sa["drafter"].items():
        err = float((a - sb["drafter"][k]).abs().max())
        assert err <= 1e-4 * max(float(a.abs().max()), 1e-3), (k, err)


def test_how_the_step_is_computed_is_not_resume_critical(tiny_assets: dict[str, Any]) -> None:
    """A run that hit an OOM may resume with a smaller budget or checkpointed layers; the
    drafter's shape under the same section still refuses a resume."""
    from trainer.config import TrainConfig, resume_critical_changes

    base = TrainConfig.from_dict(tiny_assets)
    drafter = tiny_assets["model"]["drafter"]
    safer = TrainConfig.from_dict(
        {
            **tiny_assets,
            "model": {
                **tiny_assets["model"],
                "max_query_rows": 64,
                "drafter": {**drafter, "checkpoint_layers": True},
            },
        }
    )
    assert resume_critical_changes(base, safer) == []
    deeper = TrainConfig.from_dict(
        {
            **tiny_assets,
            "model": {
                **tiny_assets["model"],
                "drafter": {**drafter, "checkpoint_layers": True, "num_layers": 3},
            },
        }
    )
    assert resume_critical_changes(base, deeper) == ["model.drafter.num_layers"]
