"""Two "nodes" on one machine: one torchrun per node (`--nnodes 2 --node-rank i
--rdzv-backend static`, as dflashctl launches a group), each with its own run dir (no shared
storage), against `run_two_ranks` (one node, two ranks) of the same config."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from dflashctl.groups.state import NodeReport, group_state
from tests import budget
from trainer.events import ErrorEvent, StatusEvent, parse_line
from trainer.events.run_state import parse_run_state
from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

from .conftest import REPO, cli_env, run_two_ranks, write_config

TOPOLOGY = {"drafter_devices": ["cpu"], "target_devices": ["cpu"]}  # one config, both layouts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _start_nodes(
    config: Path,
    run_dirs: list[Path],
    port: int,
    envs: list[dict[str, str]] | None = None,
    nproc: int = 1,
) -> list[subprocess.Popen[str]]:
    procs = []
    for i, run_dir in enumerate(run_dirs):
        env = cli_env(**(envs[i] if envs else {}))
        env.pop("WORLD_SIZE", None)
        argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(len(run_dirs))]
        argv += ["--node-rank", str(i), "--nproc-per-node", str(nproc), "--rdzv-backend", "static"]
        argv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0"]
        argv += ["-m", "trainer", "--config", str(config), "--run-dir", str(run_dir)]
        procs.append(
            subprocess.Popen(
                argv,
                cwd=REPO,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _finish(procs: list[subprocess.Popen[str]]) -> list[tuple[int, str]]:
    """Each process's exit status and output tail, waited for within the test's budget."""
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=budget.left())
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout[-2000:] + stderr[-3000:]))
    return out


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _state(run_dir: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((run_dir / "run-state.json").read_text())
    return state


def _status_step(run_dir: Path) -> int:
    log = run_dir / "status.log"
    events = [parse_line(x) for x in log.read_text().splitlines()] if log.exists() else []
    return max((e.step for e in events if isinstance(e, StatusEvent)), default=-1)


@pytest.fixture
def config(tmp_path: Path, tiny_assets: dict[str, Any]) -> Path:
    return write_config(
        tmp_path / "mn.toml",
        tiny_assets,
        topology=TOPOLOGY,
        schedule={"max_steps": 60},
        status={"interval_s": 0.3, "rate_window_s": 5.0},
    )


@pytest.mark.timeout(600)
def test_two_nodes_equal_one_node_and_resume_from_node_0_alone(
    tmp_path: Path, config: Path
) -> None:
    """2 nodes x 1 rank trains the loss sequence of 1 node x 2 ranks; each node keeps its own
    run-state; a stop of both nodes resumes at the same next step on both from node 0's
    checkpoint alone (node 1's run dir is new and empty), ending on the uninterrupted loss."""
    one = tmp_path / "one-node"
    out = run_two_ranks(config, one)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    whole = _losses(one)
    assert sorted(whole) == list(range(1, 61))

    nodes = [tmp_path / "node0", tmp_path / "node1"]
    procs = _start_nodes(config, nodes, _free_port())

    def at_step_6() -> bool:
        assert all(p.poll() is None for p in procs), _finish(procs)
        return _status_step(nodes[0]) >= 6

    budget.until(at_step_6, "node 0 at step 6")
    # dflashctl's group stop: SIGINT to each node's trainer (pid from its own run-state)
    pids = [_state(d)["pid"] for d in nodes]
    for pid in pids:
        os.kill(pid, signal.SIGINT)
    results = _finish(procs)
    assert [rc for rc, _ in results] == [0, 0], results
    (stop_step, ckpt), *_ = list_checkpoints(nodes[0])
    assert len(list_checkpoints(nodes[0])) == 1 and 6 <= stop_step < 60
    assert list_checkpoints(nodes[1]) == []  # rank 0 alone writes
    first = _losses(nodes[0])
    assert sorted(first) == list(range(1, stop_step + 1))
    assert all(first[s] == whole[s] for s in first), (first, whole)
    for i, d in enumerate(nodes):
        st = _state(d)
        assert (st["node_rank"], st["nnodes"], st["rank_range"]) == (i, 2, [i, i + 1]), st
        assert st["state"] == "stopped" and st["exit_status"] == 0 and st["step"] == stop_step
        assert st["world_size"] == 2 and st["failed_rank"] is None
        assert st["checkpoint_node"] == 0, st  # only node 0 writes checkpoints
    assert _state(nodes[0])["last_checkpoint"] == str(ckpt)
    assert _state(nodes[1])["last_checkpoint"] is None  # node 1 claims no path of its own
    assert not (nodes[1] / "status.log").exists()  # status lines: global rank 0 only

    shutil.rmtree(nodes[1])  # the other node shares nothing: it resumes from node 0's state
    results = _finish(_start_nodes(config, nodes, _free_port()))
    assert [rc for rc, _ in results] == [0, 0], results
    resumed = f"Resuming from checkpoint: step={stop_step} path={ckpt}"
    assert resumed in (nodes[0] / "status.log").read_text().splitlines()
    assert list_checkpoints(nodes[1]) == []
    again = _losses(nodes[0])
    assert [again[s] for s in range(stop_step + 1, 61)] == [
        whole[s] for s in range(stop_step + 1, 61)
    ]
    st1, st0 = _state(nodes[1]), _state(nodes[0])
    # the checkpoints are node 0's: node 1 names neither a path nor a step of its own
    assert (st1["last_step"], st1["last_checkpoint"], st1["checkpoint_node"]) == (None, None, 0)
    assert st1["state"] == "finished" and st1["step"] == 60 and st1["node_rank"] == 1
    assert st0["step"] == 60 and st0["last_step"] == 60
    assert st0["last_checkpoint"] == str(list_checkpoints(nodes[0])[-1][1])
    final = load_checkpoint(list_checkpoints(nodes[0])[-1][1])
    assert final["topology"] == {"world_size": 2, "local_world_size": 1}

    # One rank cannot continue a two-rank checkpoint: refused, naming the key.
    env = cli_env()
    env.pop("WORLD_SIZE", None)
    argv = [sys.executable, "-m", "trainer", "--config", str(config), "--run-dir", str(nodes[0])]
    single = subprocess.run(
        argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=budget.left()
    )
    assert single.returncode == 2, single.stdout[-2000:]
    assert "cannot resume: changed world_size 2 -> 1" in single.stdout


@pytest.mark.timeout(300)
def test_a_failing_node_names_its_rank_on_both_nodes(tmp_path: Path, config: Path) -> None:
    """Node 1's trainer fails (an injected drafter fault): both nodes stop, and each node's
    run-state names global rank 1 as the rank that failed first."""
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    envs: list[dict[str, str]] = [{}, {"DFLASH_FAULT": "drafter:5"}]
    results = _finish(_start_nodes(config, nodes, _free_port(), envs))
    assert all(rc != 0 for rc, _ in results), results
    for d in nodes:
        st = _state(d)
        assert st["state"] == "crashed" and st["failed_rank"] == 1, st
    errors = [e for e in map(parse_line, (nodes[0] / "status.log").read_text().splitlines())]
    assert any(isinstance(e, ErrorEvent) for e in errors)


@pytest.mark.timeout(400)
@pytest.mark.parametrize(("fault", "rank"), [("drafter:5", 2), ("target:5", 3)])
def test_under_m_to_n_the_failed_rank_is_torchruns_rank_and_names_its_node(
    tmp_path: Path, tiny_assets: dict[str, Any], fault: str, rank: int
) -> None:
    """2 nodes x (1 drafter + 1 target rank), `topology.targets = "shared"`: torchrun ranks
    0, 1 on node 0 and 2, 3 on node 1. Node 1's drafter (drafter rank 1, torchrun rank 2) or
    its target (torchrun rank 3, no drafter rank at all) fails: node 0's run-state records
    that torchrun rank, the numbering of rank_range (drafter rank 1 would fall in node 0's
    [0, 2)), so dflashctl's group view names node 1 from the run-states alone."""
    config = write_config(
        tmp_path / "mn.toml",
        tiny_assets,
        topology={"targets": "shared", "drafter_devices": ["cpu"], "target_devices": ["cpu"]},
        schedule={"max_steps": 60},
        status={"interval_s": 0.3, "rate_window_s": 5.0},
    )
    nodes = [tmp_path / "node0", tmp_path / "node1"]
    envs: list[dict[str, str]] = [{}, {"DFLASH_FAULT": fault}]
    results = _finish(_start_nodes(config, nodes, _free_port(), envs, nproc=2))
    assert all(rc != 0 for rc, _ in results), results
    states = [_state(d) for d in nodes]
    assert [st["rank_range"] for st in states] == [[0, 2], [2, 4]], states
    assert states[0]["state"] == "crashed" and states[0]["failed_rank"] == rank, states
    assert states[0]["world_size"] == 2  # drafter ranks: what sampler and checkpoints see
    if fault.startswith("drafter"):  # (a failed target's drafter is killed by its torchrun)
        assert states[1]["state"] == "crashed" and states[1]["failed_rank"] == rank, states

    reports = [
        NodeReport(
            host=f"n{i}",
            node_rank=i,
            state="crashed",
            exit_status=1,
            run_state=parse_run_state(json.dumps(st))[0],
        )
        for i, st in enumerate(states)
    ]
    view = group_state("g", reports)
    assert view.failed is not None, view
    assert (view.failed.host, view.failed.node_rank, view.failed.rank) == ("n1", 1, rank)
    assert view.summary().startswith(f"g: failed: node 1 (n1) rank {rank} failed first"), view


BROADCAST_SCRIPT = """
import sys, collections, torch, torch.distributed as dist
from trainer.pipeline.checkpoint_sync import share_state
from trainer.pipeline.distributed import World
dist.init_process_group("gloo")
rank = dist.get_rank()
world = World(rank=rank, size=2, local_rank=0, local_size=1)
sd = collections.OrderedDict(w=torch.arange(12.0).reshape(3, 4), b=torch.zeros(0))
sd._metadata = {"": {"version": 1}}
state = {
    "drafter": sd,
    "big": torch.arange(3000, dtype=torch.int64),  # larger than a bucket: sent alone
    "half": torch.tensor([1.5, -2.25], dtype=torch.bfloat16),
    "flags": torch.tensor([True, False, True]),
    "scalar": torch.tensor(7.0),
    "rng": [{"anchor": torch.randint(0, 255, (17,), dtype=torch.uint8)}, (1, "x", None)],
    "step": 5,
}
import trainer.pipeline.checkpoint_sync as cs
cs.BUCKET_BYTES = 1024
header, got = share_state(state if rank == 0 else None, {"path": "p" if rank == 0 else None},
                          world, torch.device("cpu"))
torch.save({"header": header, "state": got, "meta": getattr(got["drafter"], "_metadata", None),
            "type": type(got["drafter"]).__name__}, sys.argv[1] + f".{rank}")
dist.destroy_process_group()
"""


@pytest.mark.timeout(120)
def test_the_resume_state_reaches_every_rank_bit_for_bit(tmp_path: Path) -> None:
    """share_state: rank 0's tree of mixed tensors (bf16, bool, 0-dim, empty, one larger than
    a bucket) and plain values arrives equal on rank 1, a state_dict's type and _metadata kept."""
    script = tmp_path / "bcast.py"
    script.write_text(BROADCAST_SCRIPT)
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    out = subprocess.run(
        [*argv, str(script), str(tmp_path / "s")],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )
    assert out.returncode == 0, out.stderr[-3000:]
    sent, got = (torch.load(tmp_path / f"s.{r}", weights_only=False) for r in (0, 1))
    assert got["header"] == {"path": "p"} and got["type"] == "OrderedDict"
    assert got["meta"] == {"": {"version": 1}}
    a, b = sent["state"], got["state"]
    assert b["step"] == 5 and b["rng"][1] == (1, "x", None)
    for key in ("big", "half", "flags", "scalar"):
        assert b[key].dtype == a[key].dtype and torch.equal(b[key], a[key]), key
    assert torch.equal(b["drafter"]["w"], a["drafter"]["w"]) and b["drafter"]["b"].shape == (0,)
    assert torch.equal(b["rng"][0]["anchor"], a["rng"][0]["anchor"])


def test_buckets_pack_small_tensors_and_send_a_large_one_alone() -> None:
    from trainer.pipeline.checkpoint_sync import Slot, _buckets

    f32 = torch.float32
    slots = [Slot(0, f32, (10,)), Slot(1, f32, (300,)), Slot(2, f32, (3,)), Slot(3, f32, (100,))]
    groups = _buckets(slots, 512)
    # the 1200-byte one alone; 40 + 12 bytes share one (64-byte aligned); 400 would overflow it
    assert [[s.index for s, _ in g] for g in groups] == [[1], [0, 2], [3]]
    assert [off for _, off in groups[1]] == [0, 64]


def test_node_info_from_torchrun_env_and_single_node_run_state_unchanged(tmp_path: Path) -> None:
    from trainer.pipeline.status import NodeInfo, Reporter, RunRecord, RunStateFile

    env = {"GROUP_WORLD_SIZE": "3", "GROUP_RANK": "2", "RANK": "9", "LOCAL_RANK": "1"}
    node = NodeInfo.from_env({**env, "LOCAL_WORLD_SIZE": "4"})
    assert node == NodeInfo(node_rank=2, nnodes=3, rank_range=(8, 12))
    assert NodeInfo.from_env({"RANK": "1", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}) is None
    reporter = Reporter(tmp_path, enabled=False)
    single = RunRecord(RunStateFile(tmp_path), reporter, True)
    single(state="running", step=4, failed_rank=None)
    single.progress(5)
    assert set(_state(tmp_path)) == {"state", "updated_at"}
    multi_dir = tmp_path / "multi"
    multi_dir.mkdir()
    multi = RunRecord(RunStateFile(multi_dir), reporter, True, node)
    multi(state="running")
    multi.step_of = lambda: 7
    multi.heal()
    st = _state(multi_dir)
    assert (st["node_rank"], st["nnodes"], st["rank_range"], st["step"]) == (2, 3, [8, 12], 7)


def test_a_node_that_writes_no_checkpoints_claims_none_of_its_own(tmp_path: Path) -> None:
    """Node 1's run-state names no checkpoint path or step, whatever is handed to it or was in
    its file before (a stale run dir), and says which node holds them; node 0's keeps its own."""
    from trainer.pipeline.status import NodeInfo, Reporter, RunRecord, RunStateFile

    stale = {"last_step": 99, "last_checkpoint": "/old/step-00000099.pt", "best_checkpoint": "/b"}
    (tmp_path / "run-state.json").write_text(json.dumps(stale))
    reporter = Reporter(tmp_path, enabled=False)
    node1 = RunRecord(RunStateFile(tmp_path), reporter, True, NodeInfo(1, 2, (1, 2)))
    node1(state="starting", last_step=7, last_checkpoint="/node0/run/checkpoints/step-7.pt")
    node1(last_checkpoint="/node0/run/checkpoints/step-8.pt", last_step=8)
    st = _state(tmp_path)
    assert {k: st[k] for k in (*stale, "checkpoint_error")} == dict.fromkeys(
        (*stale, "checkpoint_error")
    ), st
    assert (st["checkpoint_node"], st["node_rank"], st["state"]) == (0, 1, "starting")
    assert parse_run_state(json.dumps(st))[0].checkpoints_elsewhere == 0

    node0_dir = tmp_path / "node0"
    node0_dir.mkdir()
    node0 = RunRecord(RunStateFile(node0_dir), reporter, True, NodeInfo(0, 2, (0, 1)))
    node0(last_step=8, last_checkpoint="/node0/run/checkpoints/step-8.pt")
    st0 = _state(node0_dir)
    assert (st0["last_step"], st0["checkpoint_node"]) == (8, 0)
    assert st0["last_checkpoint"] == "/node0/run/checkpoints/step-8.pt"
    assert parse_run_state(json.dumps(st0))[0].checkpoints_elsewhere is None
    assert parse_run_state(json.dumps(stale))[0].checkpoints_elsewhere is None  # single node
