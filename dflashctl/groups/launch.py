"""The multi-node launch of a group: one torchrun per node (pure argv and env builders).

`start GROUP` (the next increment) runs, on node i of the group, inside tmux as `start` does on
one host, `NodeLaunch.argv` with `NodeLaunch.env` added to the host's environment. Everything in
them comes from the validated inventory (plain names, absolute boring paths, IP addresses or
DNS names, interface names) or is a number, and the result goes through the same
`tmux_new_session` / `shell_join` quoting as the single-host trainer command, so no inventory
value can reach a shell or tmux as syntax.

Rendezvous: torchrun's `static` backend, not `c10d`. Under c10d torchrun ignores `--node-rank`
(it warns so) and numbers the nodes by sorting their (address, pid) descriptors, so the
inventory's node 0 can come up as group rank 1 (seen with 127.0.0.2 vs 127.0.0.10: "10" sorts
first). Node 0 is where checkpoints are written and resumed from, so its rank must be the
inventory order: `static` takes `--node-rank` as the rank and node 0 hosts the store on the
endpoint. Nothing elastic is lost: the node count is fixed and `--max-restarts 0` anyway
(restarts are the supervision policy's, one level up).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field

from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.errors import UsageError
from dflashctl.remote.run import TORCHRUN_MODULE

RDZV_BACKEND = "static"
# The trainer's own arguments, relative to the workdir (tmux starts the pane there); the same as
# control.trainer_argv's (a test keeps them equal).
TRAINER_ARGS = ("-m", "trainer", "--config", "run/config.toml", "--run-dir", "run")
IFNAME_ENV = {
    "nccl_socket_ifname": "NCCL_SOCKET_IFNAME",
    "gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
}


class LaunchError(UsageError, ValueError):
    """A launch that cannot be built (bad rank or device count, a node without an address):
    the inventory or the arguments are wrong (exit 2). Still a ValueError for its callers."""


@dataclass(frozen=True)
class NodeLaunch:
    """What one node of a group runs: `argv` = `launcher` + `program`, plus `env` to add."""

    group: str
    host: str
    node_rank: int
    nnodes: int
    nproc_per_node: int
    launcher: tuple[str, ...]  # python -m torch.distributed.run --nnodes ... (up to the program)
    program: tuple[str, ...]  # -m trainer --config ... --run-dir run --resume auto | --fresh
    env: dict[str, str] = field(default_factory=dict)

    @property
    def argv(self) -> list[str]:
        return [*self.launcher, *self.program]


def rdzv_endpoint(group: GroupConfig) -> str:
    """`HOST:PORT` of node 0's rendezvous; an IPv6 address is bracketed (`[2001:db8::1]:29400`)."""
    node0 = group.nodes[0]
    if node0.node_address is None:
        raise LaunchError(f"group {group.name!r}: node 0 {node0.name!r} has no node_address")
    host = node0.node_address
    try:
        if ipaddress.ip_address(host).version == 6:
            host = f"[{host}]"
    except ValueError:
        pass  # a DNS name
    return f"{host}:{int(group.rdzv_port)}"


def node_env(host: HostConfig) -> dict[str, str]:
    """The interface variables this node sets, only those its inventory entry gives."""
    env: dict[str, str] = {}
    for key, var in IFNAME_ENV.items():
        value = getattr(host, key)
        if value is not None:
            env[var] = value
    return env


def program_args(fresh: bool, resume: str = "auto") -> tuple[str, ...]:
    """The trainer's argv after the interpreter; `resume` as given (auto | never | STEP | PATH)."""
    return (*TRAINER_ARGS, "--fresh") if fresh else (*TRAINER_ARGS, "--resume", resume)


def node_launch(
    group: GroupConfig,
    node_rank: int,
    nproc_per_node: int,
    *,
    fresh: bool = False,
    resume: str = "auto",
) -> NodeLaunch:
    """The launch of node `node_rank` of `group`, running `nproc_per_node` ranks there."""
    _check_count("node_rank", node_rank, 0, group.nnodes - 1, group.name)
    _check_count("nproc_per_node", nproc_per_node, 1, 1024, group.name)
    host = group.nodes[node_rank]
    launcher = (
        host.python,
        "-m",
        TORCHRUN_MODULE,
        "--nnodes",
        str(group.nnodes),
        "--node-rank",
        str(node_rank),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        RDZV_BACKEND,
        "--rdzv-endpoint",
        rdzv_endpoint(group),
        "--max-restarts",
        "0",
    )
    return NodeLaunch(
        group=group.name,
        host=host.name,
        node_rank=node_rank,
        nnodes=group.nnodes,
        nproc_per_node=nproc_per_node,
        launcher=launcher,
        program=program_args(fresh, resume),
        env=node_env(host),
    )


def group_launches(
    group: GroupConfig, nprocs: list[int], *, fresh: bool = False, resume: str = "auto"
) -> list[NodeLaunch]:
    """Every node's launch, node 0 first; `nprocs[i]` = the devices node i trains on."""
    if len(nprocs) != group.nnodes:
        raise LaunchError(
            f"group {group.name!r}: {len(nprocs)} device counts for {group.nnodes} nodes"
        )
    return [
        node_launch(group, rank, n, fresh=fresh, resume=resume) for rank, n in enumerate(nprocs)
    ]


def _check_count(what: str, value: int, low: int, high: int, group: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LaunchError(f"group {group!r}: {what} {value!r} is not an integer in {low}..{high}")
