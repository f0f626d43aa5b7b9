"""A group's nodes share no storage (two Proxmox nodes each have their own /data): every node's
first process builds the synthetic store and tiny target its config names, and a node that
lacks data it cannot build refuses with its own reason, which its run-state keeps and every
node's names as the rank that failed first.

Two torchrun agents on this machine (static rendezvous), each node with its own copy of the
config in its own directory: the config's relative paths resolve there, as on two machines."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from dflashctl.groups.state import NodeReport, group_state
from trainer.config.overlay import merge
from trainer.events.run_state import parse_run_state

from .group_nodes import finish, free_port, node_dirs, run_state, start_node, static_argv

pytestmark = pytest.mark.timeout(600)


def test_every_node_builds_its_own_synthetic_store_and_tiny_target(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    raw = merge(
        tiny_assets,
        {
            "data": {"store": "data/store"},
            "model": {"target_dir": "data/target"},
            "schedule": {"max_steps": 4},
        },
    )
    nodes = node_dirs(tmp_path, raw)
    port = free_port()
    results = finish([start_node(static_argv(i, 2, port), d) for i, d in enumerate(nodes)])
    assert [rc for rc, _ in results] == [0, 0], results
    for d in nodes:
        assert (d / "data" / "store" / "manifest.json").is_file()
        assert (d / "data" / "target" / "config.json").is_file()
        assert not [p for p in (d / "data").iterdir() if p.name.startswith(".")]  # no temp left
        assert run_state(d / "run")["state"] == "finished"
    weights = [(d / "data" / "target" / "model.safetensors").read_bytes() for d in nodes]
    assert weights[0] == weights[1]  # the same seeded target on both nodes


def test_a_node_without_the_store_refuses_with_its_reason_and_is_named(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    """The store is real data (no `data.synthetic`): node 0 has a copy, node 1 none. Node 1's
    rank refuses (exit 2) with an ERROR line naming its rank and the store path; its run-state
    records `refused` with that line and itself as the failed rank, and node 0's records rank 1
    too, so the group view blames node 1 with node 1's own words."""
    raw = merge(tiny_assets, {"data": {"store": "data/store"}, "schedule": {"max_steps": 4}})
    del raw["data"]["synthetic"]
    nodes = node_dirs(tmp_path, raw)
    shutil.copytree(Path(tiny_assets["data"]["store"]), nodes[0] / "data" / "store")
    port = free_port()
    results = finish([start_node(static_argv(i, 2, port), d) for i, d in enumerate(nodes)])
    assert all(rc != 0 for rc, _ in results), results
    missing = nodes[1] / "data" / "store"
    out1 = results[1][1]
    assert f"ERROR: rank 1: data.store: {missing}" in out1, out1
    st1, st0 = run_state(nodes[1] / "run"), run_state(nodes[0] / "run")
    assert st1["state"] == "refused" and st1["exit_status"] == 2, st1
    assert st1["last_error"].startswith(f"rank 1: data.store: {missing}"), st1
    assert st1["failed_rank"] == 1 and st0["failed_rank"] == 1, (st0, st1)

    reports = [
        NodeReport(
            host=f"n{i}",
            node_rank=i,
            state="crashed",
            exit_status=1,
            run_state=parse_run_state(json.dumps(st))[0],
        )
        for i, st in enumerate((st0, st1))
    ]
    view = group_state("g", reports)
    assert view.failed is not None and (view.failed.host, view.failed.rank) == ("n1", 1), view
    assert view.failed.error == st1["last_error"], view
    assert view.summary().endswith(f": {st1['last_error']}"), view.summary()
