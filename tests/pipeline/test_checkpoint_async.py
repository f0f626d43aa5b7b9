"""Checkpoints off the drafter's hot path (issue 16 item 7): a slow write (a real stall before
the temp file's fsync, `DFLASH_STAGE_DELAY=checkpoint:S`) runs on its own thread while the
drafter keeps training; a checkpoint due meanwhile waits and says so; the end waits for the
last write; what was written resumes exactly; the finished run exports fp32 and bf16."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.events import CheckpointEvent, StatusEvent, parse_line
from trainer.model.export import load_drafter, read_drafter_config
from trainer.model.target import TargetModel
from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

from .conftest import RunCli, cli_env, write_config


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


@pytest.mark.timeout(400)
def test_a_slow_write_does_not_stop_the_drafter_and_resumes_exactly(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    run_dir = tmp_path / "run"
    cfg = write_config(
        tmp_path / "slow.toml",
        tiny_assets,
        schedule={"epochs": 0.25},  # a whole plan: the end exports
        checkpoint={"every_steps": 8, "keep_last": 3},
        status={"interval_s": 0.2, "rate_window_s": 5.0},
    )
    out = run_cli(cfg, run_dir, env=cli_env(DFLASH_STAGE_DELAY="checkpoint:3"))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (run_dir / "status.log").read_text().splitlines()
    events = [parse_line(x) for x in lines]
    saved = {e.step: i for i, e in enumerate(events) if isinstance(e, CheckpointEvent)}
    end = json.loads((run_dir / "run-state.json").read_text())["end_step"]
    assert end > 18 and sorted(saved) == [*range(8, end, 8), end]
    # While step 8's write stalled, the drafter trained on: status lines past step 8 come
    # before its "Checkpoint saved" line.
    during = [e.step for e in events[: saved[8]] if isinstance(e, StatusEvent)]
    assert max(during) > 8, during
    # 8 steps take less than the 3 s stall: the next one waited for it, and said so.
    waits = [x for x in lines if x.startswith("WARNING: checkpoint of step ")]
    assert waits and "waited" in waits[0] and "for the previous write (after step" in waits[0]
    # The end waited for the last write; retention is what it was.
    assert [s for s, _ in list_checkpoints(run_dir)] == sorted(saved)[-3:]
    assert json.loads((run_dir / "run-state.json").read_text())["last_step"] == end
    assert not [p for p in run_dir.rglob(".*") if p.is_file()]  # no temp file left
    whole = _losses(run_dir)

    # The oldest kept was copied while the drafter went on: resuming it repeats the rest exactly.
    mid = sorted(saved)[-3]
    again = run_cli(cfg, run_dir, "--resume", str(mid))
    assert again.returncode == 0, again.stderr[-3000:]
    redo = _losses(run_dir)
    assert [redo[s] for s in range(mid + 1, end + 1)] == [whole[s] for s in range(mid + 1, end + 1)]
    assert load_checkpoint(list_checkpoints(run_dir)[-1][1])["step"] == end

    # The finished plan is exported twice: fp32 master weights and the bf16 training dtype.
    fp32, bf16 = run_dir / "export", run_dir / "export-bf16"
    assert json.loads((bf16 / "config.json").read_text())["dtype"] == "bfloat16"
    assert json.loads((fp32 / "config.json").read_text())["dtype"] == "float32"
    dcfg = read_drafter_config(bf16)
    assert dcfg == read_drafter_config(fp32)
    target = TargetModel.load(Path(tiny_assets["model"]["target_dir"]), dcfg.target_layer_ids)
    full = load_drafter(fp32, target=target)
    half = load_drafter(bf16, target=target)
    for (name, a), (_, b) in zip(full.state_dict().items(), half.state_dict().items(), strict=True):
        assert b.dtype == torch.bfloat16 and torch.equal(b, a.to(torch.bfloat16)), name
    # Computed in fp32 from the bf16 weights, the logits are the fp32 export's to bf16 rounding.
    widened = load_drafter(bf16, target=target, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 60, (2, 24), generator=g)
    feats = target.capture(ids, torch.ones_like(ids))
    block = full.block_input_ids(ids[:, 10:11])
    pos = torch.arange(10, 10 + dcfg.block_size)[None]
    with torch.no_grad():
        want = full.logits(full(feats[:, :10], block, pos))
        got = widened.logits(widened(feats[:, :10], block, pos))
    assert not torch.equal(got, want)  # really the rounded weights
    torch.testing.assert_close(got, want, rtol=0.02, atol=0.02)


def test_the_host_copy_is_a_snapshot_in_reused_buffers() -> None:
    """What the writer reads is the state at the copy, whatever the drafter does next; the
    next copy reuses the same buffers (no allocation per checkpoint); types and a
    state_dict's _metadata survive."""
    from collections import OrderedDict

    from trainer.pipeline.checkpointer import HostCopy

    w = torch.nn.Parameter(torch.ones(4))
    sd: OrderedDict[str, Any] = OrderedDict(w=w)
    sd._metadata = {"": {"version": 1}}  # type: ignore[attr-defined]  # as nn.Module sets it
    state = {"drafter": sd, "rng": [(torch.tensor([1, 2], dtype=torch.uint8), "x")], "step": 3}
    host = HostCopy()
    snap = host.copy(state)
    with torch.no_grad():
        w.add_(1.0)  # the next optimizer step, in place
    assert (
        torch.equal(snap["drafter"]["w"], torch.ones(4)) and not snap["drafter"]["w"].requires_grad
    )
    assert type(snap["drafter"]) is OrderedDict
    assert getattr(snap["drafter"], "_metadata", None) == {"": {"version": 1}}
    assert snap["rng"][0][1] == "x" and snap["step"] == 3 and host.event is None  # CPU only
    again = host.copy(state)
    assert again["drafter"]["w"].data_ptr() == snap["drafter"]["w"].data_ptr()
    assert torch.equal(again["drafter"]["w"], torch.full((4,), 2.0))
