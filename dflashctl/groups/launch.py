"""The multi-node launch of a group: one torchrun per node (pure argv and env builders).

`start GROUP` runs, on node i of the group, inside tmux as `start` does on one host, the node's
supervisor (`python -m trainer.supervise --group-node i`, the group's one restart policy) in front
of `NodeLaunch.argv`, with `NodeLaunch.env` added to the host's environment. Everything in them
comes from the validated inventory (plain names, absolute boring paths, IP addresses or DNS
names, interface names) or is a number, and the result goes through the same
`tmux_new_session` / `shell_join` quoting as the single-host trainer command, so no inventory
value can reach a shell or tmux as syntax.

Rendezvous: torchrun's elastic `c10d` backend, hosted by node 0's agent (`is_host`), so a node
whose agent died and was restarted by its supervisor rejoins, and torchrun restarts the whole
worker group when any rank fails (`--max-restarts`: the group policy's). The node count is
fixed (`--nnodes N`, not MIN:MAX): the trainer refuses a changed world size on resume (the data
order and every rank's random streams depend on it), so a group trains with all N nodes or not
at all, and a rendezvous waits for the missing ones at most `rendezvous_timeout_s` (torchrun's
join timeout), then ends the group with that reason instead of waiting forever.
c10d numbers the agents by sorting (address, pid), not by `--node-rank` (ignored there), so
node 0 may be c10d's rank 1; the trainer takes its rank from DFLASH_NODE_RANK (the inventory's
order: node 0's first process is global rank 0 and writes the checkpoints). With
TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a restarted agent builds the round's bootstrap store anew
(sharing node 0's first store made a rejoin fail: `wait timeout ... MASTER_ADDR`).
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass, field
from itertools import accumulate

from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.errors import UsageError
from dflashctl.remote.run import TORCHRUN_MODULE

RDZV_BACKEND = "c10d"
# The trainer's own arguments, relative to the workdir (tmux starts the pane there); the same as
# control.trainer_argv's (a test keeps them equal).
TRAINER_ARGS = ("-m", "trainer", "--config", "run/config.toml", "--run-dir", "run")
IFNAME_ENV = {
    "nccl_socket_ifname": "NCCL_SOCKET_IFNAME",
    "gloo_socket_ifname": "GLOO_SOCKET_IFNAME",
}


# Every node's agent and trainer (the operator's env wins where it sets one of these).
GROUP_ENV = {
    # a restarted agent rebuilds the round's bootstrap store (rejoin works; see the docstring)
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
    # torchrun logs its rendezvous and restarts at INFO: the node's supervisor reads them
    "LOGLEVEL": "INFO",
    # a stop's SIGINT reaches the ranks through torchrun: time for the stop's checkpoint before
    # it SIGKILLs them (its restarts keep their own 30 s)
    "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "600",
    # NCCL: a collective that outlives the process group's timeout aborts its communicator and
    # fails the rank (torch's default too, made explicit); the watchdog thread itself must answer
    # within the heartbeat timeout (docs/dflashctl.md: timeouts and their cost)
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}
NODE_RANK_ENV = "DFLASH_NODE_RANK"  # trainer.pipeline.launch_env: the inventory's node order
RANK_BASE_ENV = "DFLASH_RANK_BASE"  # trainer.pipeline.launch_env: the node's first global rank
LAUNCH_ID_ENV = "DFLASH_LAUNCH_ID"  # trainer.pipeline.launch_env: --fresh/--resume once
COLLECTIVE_TIMEOUT_ENV = "DFLASH_COLLECTIVE_TIMEOUT_S"  # trainer.pipeline.distributed
HEARTBEAT_ENV = "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC"


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


def collective_timeout_s(group: GroupConfig) -> float:
    """A rank waits this long in one collective before it fails (the process group's timeout,
    NCCL's watchdog aborting the communicator): the backstop, the longer of the group's stall
    and startup timeouts. The bound that counts is node 0's stall watchdog: every rank joins
    each step's all-reduce, so a rank hung anywhere stops rank 0's steps and node 0's
    supervisor kills its ranks after `stall_timeout_s`, which restarts the group. The
    collective timeout must outlast every legitimate wait in a collective (another node
    building its data, rank 0 loading the checkpoint it broadcasts, an evaluation on rank 0),
    which the startup timeout is sized for; it catches a hang where node 0's watchdog cannot
    act (node 0's supervisor itself gone)."""
    return float(group.supervisor_policy().startup_timeout_s)


def launch_env(
    group: GroupConfig, node_rank: int, launch_id: str, rank_base: int
) -> dict[str, str]:
    """What node `node_rank` adds to its host's environment for its agent and its ranks."""
    timeout = collective_timeout_s(group)
    return {
        **GROUP_ENV,
        NODE_RANK_ENV: str(node_rank),
        RANK_BASE_ENV: str(rank_base),
        LAUNCH_ID_ENV: launch_id,
        COLLECTIVE_TIMEOUT_ENV: f"{timeout:g}",
        # the NCCL watchdog's own liveness: longer than one collective may wait
        HEARTBEAT_ENV: f"{int(timeout) + 60}",
    }


def node_launch(
    group: GroupConfig,
    node_rank: int,
    nproc_per_node: int,
    *,
    fresh: bool = False,
    resume: str = "auto",
    launch_id: str = "",
    rank_base: int | None = None,
) -> NodeLaunch:
    """The launch of node `node_rank` of `group`, running `nproc_per_node` ranks there;
    `launch_id` names this start (every attempt of it applies --fresh/--resume once);
    `rank_base` is its first global rank (default: every node runs `nproc_per_node`)."""
    _check_count("node_rank", node_rank, 0, group.nnodes - 1, group.name)
    _check_count("nproc_per_node", nproc_per_node, 1, 1024, group.name)
    host = group.nodes[node_rank]
    if host.node_address is None:
        raise LaunchError(
            f"group {group.name!r}: node {node_rank} {host.name!r} has no node_address"
        )
    policy = group.supervisor_policy()
    conf = f"is_host={'true' if node_rank == 0 else 'false'},join_timeout={int(group.rendezvous_timeout_s)}"
    launcher = (
        host.python,
        "-m",
        TORCHRUN_MODULE,
        "--nnodes",
        str(group.nnodes),
        "--nproc-per-node",
        str(nproc_per_node),
        "--rdzv-backend",
        RDZV_BACKEND,
        "--rdzv-endpoint",
        rdzv_endpoint(group),
        "--rdzv-id",
        group.name,
        "--rdzv-conf",
        conf,
        "--local-addr",
        host.node_address,
        "--max-restarts",
        str(policy.max_restarts if policy.restart == "on-failure" else 0),
    )
    base = node_rank * nproc_per_node if rank_base is None else rank_base
    env = {**node_env(host), **launch_env(group, node_rank, launch_id or group.name, base)}
    return NodeLaunch(
        group=group.name,
        host=host.name,
        node_rank=node_rank,
        nnodes=group.nnodes,
        nproc_per_node=nproc_per_node,
        launcher=launcher,
        program=program_args(fresh, resume),
        env=env,
    )


def group_launches(
    group: GroupConfig,
    nprocs: list[int],
    *,
    fresh: bool = False,
    resume: str = "auto",
    launch_id: str = "",
) -> list[NodeLaunch]:
    """Every node's launch, node 0 first; `nprocs[i]` = the devices node i trains on."""
    if len(nprocs) != group.nnodes:
        raise LaunchError(
            f"group {group.name!r}: {len(nprocs)} device counts for {group.nnodes} nodes"
        )
    return [
        node_launch(group, rank, n, fresh=fresh, resume=resume, launch_id=launch_id, rank_base=base)
        for rank, (n, base) in enumerate(zip(nprocs, accumulate([0, *nprocs]), strict=False))
    ]


def supervisor_args(group: GroupConfig, node_rank: int) -> list[str]:
    """The node's supervisor flags: the group's policy, the same on every node, and its index."""
    return [*group.supervisor_policy().cli_args(), "--group-node", str(node_rank)]


def _check_count(what: str, value: int, low: int, high: int, group: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise LaunchError(f"group {group!r}: {what} {value!r} is not an integer in {low}..{high}")
