"""Two nodes on torchrun's c10d rendezvous, as dflashctl launches a group: c10d numbers the
nodes by sorting (address, pid), so the node whose agent has the lower pid is its group rank 0;
the trainer takes its global rank from the inventory's node order instead (DFLASH_NODE_RANK),
so node 0's first process is global rank 0, writes the status lines and the checkpoints, and
the loss sequence is the static launch's, whichever agent c10d put first."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from trainer.config.overlay import merge

from .group_nodes import (
    c10d_argv,
    c10d_env,
    finish,
    free_port,
    node_dirs,
    run_state,
    start_node,
    static_argv,
)

pytestmark = pytest.mark.timeout(600)


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows]


def test_node_0_is_global_rank_0_when_c10d_puts_it_second(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    raw = merge(tiny_assets, {"schedule": {"max_steps": 6}})
    static = node_dirs(tmp_path / "static", raw)
    port = free_port()
    done = finish([start_node(static_argv(i, 2, port), d) for i, d in enumerate(static)])
    assert [rc for rc, _ in done] == [0, 0], done

    nodes = node_dirs(tmp_path / "c10d", raw)
    port = free_port()
    # node 1's agent forked first: the lower pid, so c10d makes it group rank 0 (torchrun's
    # RANK 0 runs there and hosts the workers' store)
    first = start_node(c10d_argv(1, 2, port), nodes[1], c10d_env(1))
    assert first.pid is not None
    second = start_node(c10d_argv(0, 2, port), nodes[0], c10d_env(0))
    done = finish([second, first])
    assert [rc for rc, _ in done] == [0, 0], done
    node0_out = done[0][1]
    assert re.search(r"group_rank=1\b", node0_out), node0_out  # c10d: node 0 came second

    st0, st1 = run_state(nodes[0] / "run"), run_state(nodes[1] / "run")
    assert (st0["node_rank"], st0["rank_range"]) == (0, [0, 1]), st0
    assert (st1["node_rank"], st1["rank_range"]) == (1, [1, 2]), st1
    assert (nodes[0] / "run" / "status.log").is_file()
    assert not (nodes[1] / "run" / "status.log").exists()  # status lines: global rank 0 only
    assert list((nodes[0] / "run" / "checkpoints").glob("step-*.pt"))
    assert not list((nodes[1] / "run").glob("checkpoints/step-*.pt"))
    assert _losses(nodes[0] / "run") == _losses(static[0] / "run")
