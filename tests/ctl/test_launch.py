"""The group launch builder: torchrun argv and env per node, quoting, and a real 2-node launch."""

from __future__ import annotations

import json
import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from dflashctl.config.inventory import GroupConfig, Inventory, InventoryError, parse_inventory
from dflashctl.groups.launch import (
    RDZV_BACKEND,
    LaunchError,
    group_launches,
    node_launch,
    rdzv_endpoint,
)
from dflashctl.remote.commands import clean_env, pct_exec, shell_join, tmux_new_session
from dflashctl.remote.run import trainer_argv
from tests import budget

PY = "/opt/venv/bin/python"


def inventory(
    tmp_path: Path, nodes: dict[str, str], extra: str = "", port: int | None = None
) -> Inventory:
    """Hosts n0, n1, ... with the given node_address and per-host extra lines, one group `g`."""
    text = f'[defaults]\npython = "{PY}"\n'
    for i, (name, address) in enumerate(nodes.items()):
        text += (
            f'[hosts.{name}]\naddress = "pve{i}"\nctid = {200 + i}\nnode_address = "{address}"\n'
        )
        text += extra.replace("{i}", str(i))
    text += f"[groups.g]\nhosts = {json.dumps(list(nodes))}\n"
    if port is not None:
        text += f"rdzv_port = {port}\n"
    return parse_inventory(text, tmp_path / "hosts.toml")


def flags(argv: list[str]) -> dict[str, str]:
    """torchrun's `--flag value` pairs before the program."""
    at = argv.index("-m", 3)  # the program's -m (argv[1:3] is `-m torch.distributed.run`)
    pairs = argv[3:at]
    return dict(zip(pairs[::2], pairs[1::2], strict=True))


def test_every_node_gets_its_rank_the_node_count_and_node_0s_endpoint(tmp_path: Path) -> None:
    group = inventory(
        tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11", "n2": "node-2.example"}
    ).groups["g"]
    launches = group_launches(group, [8, 4, 8])
    assert [(x.host, x.node_rank) for x in launches] == [("n0", 0), ("n1", 1), ("n2", 2)]
    addresses = ["192.0.2.10", "192.0.2.11", "node-2.example"]
    for x, nproc in zip(launches, [8, 4, 8], strict=True):
        assert x.argv[:3] == [PY, "-m", "torch.distributed.run"]
        host = "true" if x.node_rank == 0 else "false"
        assert flags(x.argv) == {
            "--nnodes": "3",  # fixed N: the trainer refuses another world size
            "--nproc-per-node": str(nproc),
            "--rdzv-backend": "c10d",
            "--rdzv-endpoint": "192.0.2.10:29400",  # node 0's, on every node
            "--rdzv-id": "g",
            "--rdzv-conf": f"is_host={host},join_timeout=600",  # node 0 hosts it
            "--local-addr": addresses[x.node_rank],
            "--max-restarts": "3",  # the group policy's (a host's default)
        }
        assert (x.nnodes, x.nproc_per_node, x.group) == (3, nproc, "g")
        assert x.env["DFLASH_NODE_RANK"] == str(x.node_rank)
        assert x.env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_the_inventory_order_not_the_address_order_is_the_rank(tmp_path: Path) -> None:
    # 192.0.2.9 sorts after 192.0.2.10 as text: c10d makes n1 its rank 0; the list decides the
    # trainer's ranks (DFLASH_NODE_RANK), c10d's --node-rank would be ignored (not given)
    group = inventory(tmp_path, {"n0": "192.0.2.9", "n1": "192.0.2.10"}, port=29555).groups["g"]
    x0, x1 = group_launches(group, [1, 1])
    assert x0.env["DFLASH_NODE_RANK"] == "0" and x1.env["DFLASH_NODE_RANK"] == "1"
    assert "--node-rank" not in x0.argv
    assert flags(x1.argv)["--rdzv-endpoint"] == "192.0.2.9:29555"
    assert RDZV_BACKEND == "c10d"


def test_the_group_policy_reaches_torchrun_and_every_nodes_supervisor(tmp_path: Path) -> None:
    """One policy for the group: torchrun's --max-restarts, the rendezvous timeout, the same
    supervisor flags on every node (with its index), the collective timeout from the stall
    timeout, one launch id for every node of one start."""
    from dflashctl.groups.launch import supervisor_args

    group = inventory(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"}).groups["g"]
    group = group.model_copy(
        update={
            "max_restarts": 5,
            "stall_timeout_s": 120.0,
            "startup_timeout_s": 300.0,
            "rendezvous_timeout_s": 90.0,
        }
    )
    x0, x1 = group_launches(group, [1, 1], launch_id="g-1")
    assert flags(x1.argv)["--max-restarts"] == "5"
    assert flags(x1.argv)["--rdzv-conf"] == "is_host=false,join_timeout=90"
    assert x0.env["DFLASH_LAUNCH_ID"] == x1.env["DFLASH_LAUNCH_ID"] == "g-1"
    assert x0.env["DFLASH_COLLECTIVE_TIMEOUT_S"] == "300"  # the startup timeout: the backstop
    assert x0.env["TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"] == "360"
    assert x0.env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    a0, a1 = supervisor_args(group, 0), supervisor_args(group, 1)
    assert a0[:-1] == a1[:-1] and (a0[-2:], a1[-2:]) == (
        ["--group-node", "0"],
        ["--group-node", "1"],
    )
    assert "--max-restarts=5" in a0 and "--stall-timeout-s=120.0" in a0
    never = group.model_copy(update={"restart": "never"})
    assert flags(node_launch(never, 0, 1).argv)["--max-restarts"] == "0"


@pytest.mark.parametrize(
    ("address", "endpoint"),
    [
        ("2001:db8::1", "[2001:db8::1]:29400"),
        ("2001:DB8:0:0::1", "[2001:db8::1]:29400"),  # normalised at load
        ("::1", "[::1]:29400"),
        ("127.0.0.1", "127.0.0.1:29400"),
        ("node-0.cluster.example", "node-0.cluster.example:29400"),
    ],
)
def test_the_endpoint_brackets_ipv6(tmp_path: Path, address: str, endpoint: str) -> None:
    group = inventory(tmp_path, {"n0": address, "n1": "192.0.2.11"}).groups["g"]
    assert rdzv_endpoint(group) == endpoint
    assert flags(node_launch(group, 1, 1).argv)["--rdzv-endpoint"] == endpoint


def test_interface_variables_only_when_set_and_per_node(tmp_path: Path) -> None:
    inv = inventory(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11", "n2": "192.0.2.12"})
    launched = group_launches(inv.groups["g"], [1, 1, 1])
    assert not any(k.endswith("SOCKET_IFNAME") for x in launched for k in x.env)
    # n0 both, n1 NCCL only (with NCCL's own syntax), n2 nothing
    path = tmp_path / "hosts.toml"
    text = (
        f'[defaults]\npython = "{PY}"\n'
        '[hosts.n0]\naddress = "p0"\nctid = 200\nnode_address = "192.0.2.10"\n'
        'nccl_socket_ifname = "eth1"\ngloo_socket_ifname = "eth1,eth2"\n'
        '[hosts.n1]\naddress = "p1"\nctid = 200\nnode_address = "192.0.2.11"\n'
        'nccl_socket_ifname = "^=docker0,lo"\n'
        '[hosts.n2]\naddress = "p2"\nctid = 200\nnode_address = "192.0.2.12"\n'
        '[groups.g]\nhosts = ["n0", "n1", "n2"]\n'
    )
    group = parse_inventory(text, path).groups["g"]
    envs = [
        {k: v for k, v in x.env.items() if k.endswith("SOCKET_IFNAME")}
        for x in group_launches(group, [1, 1, 1])
    ]
    assert envs == [
        {"NCCL_SOCKET_IFNAME": "eth1", "GLOO_SOCKET_IFNAME": "eth1,eth2"},
        {"NCCL_SOCKET_IFNAME": "^=docker0,lo"},
        {},
    ]
    # MASTER_ADDR-style variables are the rendezvous' business, never set here
    assert not any(k.startswith(("MASTER_", "RANK", "WORLD_")) for e in envs for k in e)


@pytest.mark.parametrize(
    ("fresh", "resume"), [(False, "auto"), (False, "never"), (False, "1200"), (True, "auto")]
)
def test_the_program_is_the_single_host_trainer_command(
    tmp_path: Path, fresh: bool, resume: str
) -> None:
    group = inventory(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"}).groups["g"]
    x = node_launch(group, 0, 2, fresh=fresh, resume=resume)
    assert list(x.program) == trainer_argv(PY, fresh, resume)[1:]
    assert x.argv == [*x.launcher, *x.program] and x.argv[-1] == ("--fresh" if fresh else resume)


@pytest.mark.parametrize(
    ("rank", "nproc", "expected"),
    [
        (2, 1, "node_rank 2 is not an integer in 0..1"),
        (-1, 1, "node_rank -1 is not"),
        (True, 1, "node_rank True is not"),
        (0, 0, "nproc_per_node 0 is not an integer in 1..1024"),
        (0, 1.0, "nproc_per_node 1.0 is not"),
        (0, False, "nproc_per_node False is not"),
    ],
)
def test_bad_ranks_and_device_counts_are_refused(
    tmp_path: Path, rank: object, nproc: object, expected: str
) -> None:
    group = inventory(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"}).groups["g"]
    with pytest.raises(LaunchError, match=f"group 'g': {expected}"):
        node_launch(group, rank, nproc)  # type: ignore[arg-type]
    with pytest.raises(LaunchError, match="group 'g': 1 device counts for 2 nodes"):
        group_launches(group, [1])


HOSTILE_RESUME = ["ckpt; reboot", "$(reboot)", "`id`", "a'b\"c", "x;", "#{pane_pid}", "-h", "a\\;"]


@pytest.mark.parametrize("resume", HOSTILE_RESUME)
def test_the_remote_command_line_carries_every_value_as_one_word(
    tmp_path: Path, resume: str
) -> None:
    """Through tmux_new_session, clean_env, pct exec and the host shell's quoting, intact."""
    group = inventory(
        tmp_path,
        {"n0": "2001:db8::1", "n1": "node-1.example"},
        'nccl_socket_ifname = "^=docker0,lo"\ngloo_socket_ifname = "eth{i}"\n',
    ).groups["g"]
    for x in group_launches(group, [1, 1], resume=resume):
        host = group.nodes[x.node_rank]
        env = {**host.env, **x.env}
        tmux_argv = tmux_new_session(host.session, x.argv, cwd=host.workdir, env=env)
        line = shell_join(pct_exec(host.ctid, clean_env(tmux_argv)))
        words = shlex.split(line)
        assert words == pct_exec(host.ctid, clean_env(tmux_argv))  # nothing split or merged
        program = words[len(words) - len(x.argv) :]
        # tmux drops a trailing ';' as a command separator: it is sent escaped, the rest as is
        assert program[:-1] == x.argv[:-1]
        assert program[-1] == (resume[:-1] + "\\;" if resume.endswith(";") else resume)
        assert "NCCL_SOCKET_IFNAME=^=docker0,lo" in words
        assert f"GLOO_SOCKET_IFNAME=eth{x.node_rank}" in words


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("node_address", "10.0.0.1;reboot"),
        ("node_address", "$(reboot)"),
        ("node_address", "a b"),
        ("nccl_socket_ifname", "eth0;x"),
        ("gloo_socket_ifname", "#{pid}"),
    ],
)
def test_hostile_inventory_values_never_reach_a_launch(
    tmp_path: Path, key: str, value: str
) -> None:
    # Every way to a GroupConfig validates: the file, and building the models directly.
    nodes = {"n0": value if key == "node_address" else "192.0.2.10", "n1": "192.0.2.11"}
    extra = "" if key == "node_address" else f'{key} = "{value}"\n'
    with pytest.raises(InventoryError, match=f"host 'n0': {key}: "):
        inventory(tmp_path, nodes, extra)
    good = inventory(tmp_path, {"n0": "192.0.2.10", "n1": "192.0.2.11"}).groups["g"]
    from pydantic import ValidationError

    with pytest.raises(ValidationError):
        good.nodes[0].model_validate({**good.nodes[0].model_dump(), key: value})
    with pytest.raises(ValidationError):
        GroupConfig(name="g;x", nodes=good.nodes)


# --- a real launch: two torchrun agents (nodes) on loopback ---------------------------------

PROBE = """
import json, os, sys
import torch, torch.distributed as dist
from trainer.pipeline.launch_env import launch_rank
dist.init_process_group("gloo")
t = torch.tensor([float(dist.get_rank())])
dist.all_reduce(t)
row = {k: os.environ.get(k) for k in ("RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
       "GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NODE", "DFLASH_NODE_RANK")}
row["sum"] = t.item()
row["launch_rank"] = launch_rank()
with open(os.path.join(sys.argv[1], f"rank-{row['launch_rank']}.json"), "w") as f:
    json.dump(row, f)
dist.destroy_process_group()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.timeout(180)
def test_two_nodes_launched_as_built_form_one_world_in_inventory_order(tmp_path: Path) -> None:
    """The launcher part of the argv, run for real (c10d, node 0 hosting): one world, and the
    trainer's ranks (`launch_rank`) follow the list although c10d put node 1's agent, started
    first (the lower pid), at its group rank 0; the env reaches the ranks."""
    pytest.importorskip("torch.distributed.run")
    port = _free_port()
    text = (
        f'[defaults]\npython = "{sys.executable}"\ngloo_socket_ifname = "lo"\n'
        '[hosts.n0]\naddress = "p0"\nctid = 200\nnode_address = "127.0.0.1"\n'
        'nccl_socket_ifname = "=lo"\n'
        '[hosts.n1]\naddress = "p1"\nctid = 201\nnode_address = "127.0.0.1"\n'
        f'[groups.g]\nhosts = ["n0", "n1"]\nrdzv_port = {port}\n'
    )
    group = parse_inventory(text, tmp_path / "hosts.toml").groups["g"]
    probe = tmp_path / "probe.py"
    probe.write_text(PROBE)
    out = tmp_path / "out"
    out.mkdir()
    procs = []
    # node 1 first: arrival order must not decide the ranks
    for x in reversed(group_launches(group, [2, 1])):
        env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "WORLD", "MASTER"))}
        env.update(x.env, NODE=str(x.node_rank), OMP_NUM_THREADS="1")
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
        procs.append(
            subprocess.Popen(
                [*x.launcher, str(probe), str(out)],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        for p in procs:
            budget.wait(p, "a launched node's probe")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [p.stdout.read()[-2000:] if p.stdout else "" for p in procs]
    assert all(p.returncode == 0 for p in procs), logs
    rows = {
        int(r["launch_rank"]): r
        for r in (json.loads(f.read_text()) for f in out.glob("rank-*.json"))
    }
    assert sorted(rows) == [0, 1, 2]
    assert all(r["WORLD_SIZE"] == "3" and r["sum"] == 3.0 for r in rows.values())
    # node 0 (2 devices) holds the trainer's ranks 0-1, node 1 rank 2: the inventory order;
    # c10d numbered the agents the other way round (node 1 started first: GROUP_RANK 0)
    assert [
        (rows[i]["NODE"], rows[i]["GROUP_RANK"], rows[i]["LOCAL_WORLD_SIZE"]) for i in range(3)
    ] == [
        ("0", "1", "2"),
        ("0", "1", "2"),
        ("1", "0", "1"),
    ]
    assert [rows[i]["NCCL_SOCKET_IFNAME"] for i in range(3)] == ["=lo", "=lo", None]
    assert all(rows[i]["GLOO_SOCKET_IFNAME"] == "lo" for i in range(3))
