"""Data parallelism on CPU with gloo: two real processes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from trainer.events import StatusEvent, parse_line
from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

from .conftest import run_rank_script, run_two_ranks, write_config

RANK_SCRIPT = """
import sys, torch, torch.distributed as dist
from trainer.pipeline.distributed import World, reduce_gradients
dist.init_process_group("gloo")
rank = dist.get_rank()
# Different token counts per rank: the mean must weight tokens, not ranks.
x = [torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]), torch.tensor([10.0, -2.0])][rank]
w = torch.nn.Parameter(torch.tensor(0.5))
((w * x) ** 2).sum().backward()
total = torch.tensor(float(x.numel()))
dist.all_reduce(total)
reduce_gradients([w], World(rank=rank, size=2), 1.0 / float(total))
torch.save(w.grad, sys.argv[1] + f".{rank}")
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_gradients_are_normalised_by_the_global_weight(tmp_path: Path) -> None:
    """Two ranks' all-reduced, globally normalised gradient equals one process on all tokens."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    out = run_rank_script(script, str(tmp_path / "g"))
    assert out.returncode == 0, out.stderr[-3000:]
    w = torch.nn.Parameter(torch.tensor(0.5))
    x = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0, 10.0, -2.0])
    torch.autograd.backward(((w * x) ** 2).mean())
    assert w.grad is not None
    for rank in (0, 1):
        assert torch.allclose(torch.load(tmp_path / f"g.{rank}"), w.grad)


@pytest.mark.timeout(240)
def test_two_gloo_ranks_train_through_torchrun(tmp_path: Path, tiny_assets: dict[str, Any]) -> None:
    """`torchrun --nproc-per-node 2 -m trainer`: both ranks step together; rank 0 reports."""
    cfg = write_config(
        tmp_path / "dp.toml",
        tiny_assets,
        topology={"drafter_devices": ["cpu", "cpu"], "target_devices": ["cpu"]},
        schedule={"max_steps": 12},
    )
    run_dir = tmp_path / "run"
    out = run_two_ranks(cfg, run_dir)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    lines = (run_dir / "status.log").read_text().splitlines()
    status = [e for e in map(parse_line, lines) if isinstance(e, StatusEvent)]
    assert status[-1].step == 12 and all(len(s.q_hs) == 2 for s in status if s.step > 0)
    assert sum(1 for x in lines if x.startswith("Training finished.")) == 1  # rank 0 only
    state = load_checkpoint(list_checkpoints(run_dir)[-1][1])
    assert state["world_size"] == 2 and len(state["rng"]) == 2
    assert not torch.equal(state["rng"][0]["anchor"], state["rng"][1]["anchor"])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 13))
