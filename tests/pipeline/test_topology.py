"""M:N topologies (issue 16, item 6): target ranks serving drafter ranks (`topology.targets =
"shared"`). Routing is a pure function (every drafter's batch captured exactly once, in the
order it is consumed); a 1 target : 2 drafter run on CPU processes trains exactly the losses of
the 1:1 run (two drafter ranks, each with its own target); its status line keeps one q_hs per
drafter and names the real bottleneck."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests import budget
from trainer.config import ConfigError, TrainConfig
from trainer.events import StatusEvent, parse_line
from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint
from trainer.pipeline.distributed import Layout

from .conftest import RunCli, run_ranks, run_two_ranks, start_ranks, write_config

SHARED = {"targets": "shared", "target_devices": ["cpu"], "drafter_devices": ["cpu", "cpu"]}
STEPS = 10


def _losses(run_dir: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r["loss"]) for r in rows]


def _status(run_dir: Path) -> list[StatusEvent]:
    lines = (run_dir / "status.log").read_text().splitlines()
    return [e for e in map(parse_line, lines) if isinstance(e, StatusEvent)]


@pytest.mark.parametrize(("n", "m", "nnodes"), [(2, 1, 1), (6, 1, 1), (6, 2, 1), (3, 2, 2)])
def test_every_batch_is_captured_once_by_its_source_in_consumption_order(
    n: int, m: int, nnodes: int
) -> None:
    lay = Layout(n, m, nnodes)
    start, end = 3, 17
    seen: dict[tuple[int, int], int] = {}
    for t in range(m * nnodes):
        served = lay.served(t, start, end)
        order = [s * n + d % n for d, s in served]
        assert order == sorted(order)  # in the order the node's drafters consume
        for d, s in served:
            assert (d, s) not in seen and lay.source(d, s) == t
            assert d // n == t // m  # a node's targets serve that node's drafters
            seen[(d, s)] = t
    assert sorted(seen) == [(d, s) for d in range(n * nnodes) for s in range(start, end)]
    procs = [lay.drafter_process(d) for d in range(lay.drafters)]
    procs += [lay.target_process(t) for t in range(m * nnodes)]
    assert sorted(procs) == list(range(lay.processes))


def test_each_device_runs_one_rank(tiny_assets: dict[str, Any]) -> None:
    """With shared targets a GPU listed twice is one line naming the key and the device;
    "cpu" may repeat (CPU processes), and per_rank keeps today's sharing."""
    for topo, key, dev in (
        ({"target_devices": ["cuda:0"], "drafter_devices": ["cuda:0", "cuda:1"]}, "drafter", 0),
        ({"target_devices": ["cuda:2", "cuda:2"], "drafter_devices": ["cuda:0"]}, "target", 2),
        ({"target_devices": ["cuda"], "drafter_devices": ["cuda:0"]}, "drafter", 0),
    ):
        with pytest.raises(ConfigError) as err:
            TrainConfig.from_dict({**tiny_assets, "topology": {"targets": "shared", **topo}})
        msg = str(err.value)
        assert f"topology.{key}_devices" in msg and f"cuda:{dev}" in msg and "\n" not in msg
    TrainConfig.from_dict({**tiny_assets, "topology": SHARED})
    per_rank = {"target_devices": ["cuda:0"], "drafter_devices": ["cuda:0"]}
    TrainConfig.from_dict({**tiny_assets, "topology": per_rank})


def test_a_launch_of_the_wrong_size_is_refused_naming_the_process_count(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    cfg = write_config(tmp_path / "mn.toml", tiny_assets, topology=SHARED)
    out = run_cli(cfg, tmp_path / "r")
    assert out.returncode == 2, out.stderr[-2000:]
    assert "topology.targets = 'shared'" in out.stdout
    assert "torchrun --nproc-per-node 3" in out.stdout


@pytest.mark.timeout(600)
def test_one_target_for_two_drafters_trains_the_one_to_one_losses_through_a_stop(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    """1 target rank : 2 drafter ranks (3 processes) against 2 drafter ranks with a target
    thread each: the same features in the same order, so the very same loss sequence, also
    across a stop (SIGINT to every rank, as dflashctl stops a run: the target rank ignores it,
    the drafters agree on the step, checkpoint, release the target, exit 0) and an M:N resume;
    one q_hs per drafter in every status line; the checkpoint is a 2-rank one."""
    one_to_one = write_config(
        tmp_path / "11.toml",
        tiny_assets,
        topology={"target_devices": ["cpu"], "drafter_devices": ["cpu", "cpu"]},
        schedule={"max_steps": STEPS},
    )
    shared = write_config(
        tmp_path / "mn.toml",
        tiny_assets,
        topology=SHARED,
        schedule={"max_steps": STEPS},
        status={"interval_s": 0.3, "rate_window_s": 5.0},
    )
    a = run_two_ranks(one_to_one, tmp_path / "11")
    assert a.returncode == 0, (a.stdout[-2000:], a.stderr[-3000:])
    whole = dict(_losses(tmp_path / "11"))
    assert sorted(whole) == list(range(1, STEPS + 1))

    run_dir = tmp_path / "mn"
    proc = start_ranks(shared, run_dir, 3, DFLASH_STAGE_DELAY="drafter:0.3")
    try:

        def at_step_3() -> bool:
            assert proc.poll() is None, proc.communicate()
            status = _status(run_dir) if (run_dir / "status.log").exists() else []
            return bool(status) and status[-1].step >= 3

        budget.until(at_step_3, "the ranks at step 3", every=0.1)
        # dflashctl's stop: SIGINT to each of torchrun's children (the target rank's too)
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 3
        for pid in children:
            os.kill(int(pid), signal.SIGINT)
        out, err = proc.communicate(timeout=budget.left())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, (out[-2000:], err[-3000:])
    state = json.loads((run_dir / "run-state.json").read_text())
    assert state["state"] == "stopped" and state["lost_steps"] == 0, state
    stop_step = list_checkpoints(run_dir)[-1][0]
    assert 3 <= stop_step < STEPS
    status = _status(run_dir)
    assert status and all(len(s.q_hs) == 2 for s in status if s.step > 0)
    assert all(0 <= q <= 1 for s in status for q in s.q_hs)  # M:N: one packet ahead at most

    b = run_ranks(shared, run_dir, 3)  # resumes at stop_step: the target starts there too
    assert b.returncode == 0, (b.stdout[-2000:], b.stderr[-3000:])
    assert f"Resuming from checkpoint: step={stop_step}" in b.stdout
    assert dict(_losses(run_dir)) == whole  # the later line of a re-run step wins
    ckpt = load_checkpoint(list_checkpoints(run_dir)[-1][1])
    assert ckpt["world_size"] == 2 and len(ckpt["rng"]) == 2


@pytest.mark.timeout(600)
@pytest.mark.parametrize(("slow", "expected"), [("target", "target"), ("drafter", "drafter")])
def test_the_status_line_names_the_real_bottleneck(
    tmp_path: Path, tiny_assets: dict[str, Any], slow: str, expected: str
) -> None:
    """A slowed target rank (every drafter waits for features) reads bottleneck=target; a
    slowed drafter (the target rank waits for room) reads bottleneck=drafter."""
    cfg = write_config(
        tmp_path / "mn.toml",
        tiny_assets,
        topology=SHARED,
        schedule={"max_steps": 16},
        status={"interval_s": 0.5, "rate_window_s": 5.0},
    )
    out = run_ranks(cfg, tmp_path / "run", 3, DFLASH_STAGE_DELAY=f"{slow}:0.25")
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    named = [s.extra.get("bottleneck") for s in _status(tmp_path / "run") if s.step > 2]
    named = [x for x in named if x is not None]
    assert named and named.count(expected) >= len(named) - 1, named


@pytest.mark.timeout(600)
def test_two_targets_for_one_drafter_train_the_single_process_losses(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """2 target ranks : 1 drafter rank: batches alternate between the targets, and the drafter
    still trains the losses of a plain single-process run (one target thread), bit for bit."""
    single = write_config(tmp_path / "1.toml", tiny_assets, schedule={"max_steps": STEPS})
    shared = write_config(
        tmp_path / "21.toml",
        tiny_assets,
        topology={
            "targets": "shared",
            "target_devices": ["cpu", "cpu"],
            "drafter_devices": ["cpu"],
        },
        schedule={"max_steps": STEPS},
    )
    a = run_cli(single, tmp_path / "1")
    assert a.returncode == 0, a.stderr[-3000:]
    b = run_ranks(shared, tmp_path / "21", 3)
    assert b.returncode == 0, (b.stdout[-2000:], b.stderr[-3000:])
    assert _losses(tmp_path / "21") == _losses(tmp_path / "1")
    assert all(len(s.q_hs) == 1 for s in _status(tmp_path / "21"))
