"""Data parallelism without a DDP wrapper: each rank sums its unnormalised gradients and one
all-reduce of a flat buffer adds them; the caller divides by the GLOBAL weight sum, so the loss
is an exact token-weighted mean over every micro-batch of every rank (grad accumulation and
rank count do not change the result). Launched by torchrun (env://); gloo on CPU, NCCL on GPU.

Devices: every thread that touches a GPU binds it first (`bind_thread`: the CUDA current device
is per thread, and a new thread starts on cuda:0); NCCL gets this rank's device at init
(`device_id`), and barriers and object collectives name it, so ranks never meet on GPU 0.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

from trainer.config import TopologyConfig, TrainConfig
from trainer.pipeline.assets import UserError
from trainer.pipeline.launch_env import launch_rank, node_rank


@dataclass(frozen=True)
class Layout:
    """The processes of an M:N run (`topology.targets = "shared"`): on each node, local ranks
    0..N-1 train (drafter ranks, data parallel) and N..N+M-1 capture (target ranks). Drafter
    d's micro-batch s comes from its node's target (s*N + i) % M, i = d's index on the node:
    round robin in the order the drafters consume, so every target serves every drafter."""

    n: int  # drafter ranks per node
    m: int  # target ranks per node
    nnodes: int = 1

    @property
    def drafters(self) -> int:
        return self.n * self.nnodes

    @property
    def processes(self) -> int:
        return (self.n + self.m) * self.nnodes

    def drafter_process(self, d: int) -> int:
        node, i = divmod(d, self.n)
        return node * (self.n + self.m) + i

    def target_process(self, t: int) -> int:
        node, j = divmod(t, self.m)
        return node * (self.n + self.m) + self.n + j

    def source(self, d: int, seq: int) -> int:
        """The target (index) that captures drafter d's micro-batch `seq`."""
        node, i = divmod(d, self.n)
        return node * self.m + (seq * self.n + i) % self.m

    def served(self, t: int, start: int, end: int) -> list[tuple[int, int]]:
        """(drafter, seq) that target t captures for micro-batches [start, end), in order."""
        node, j = divmod(t, self.m)
        first = start * self.n
        first += (j - first) % self.m
        return [
            (node * self.n + g % self.n, g // self.n) for g in range(first, end * self.n, self.m)
        ]


@dataclass(frozen=True)
class World:
    """This process's place among the drafter ranks (the default process group's members).
    In an M:N run the target ranks are not in it: `rank`/`size` count drafters only, and
    `layout` says where the target ranks are."""

    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1
    device: str = "cpu"  # this rank's drafter device (bound by init_world on CUDA)
    layout: Layout | None = None  # M:N: target ranks serve this one (topology.targets)
    # this process's rank in the whole launch, torchrun's RANK (what its logs and an operator
    # see); M:N: counts drafters and targets, so it differs from `rank`
    process: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def bind_thread(device: torch.device | str) -> None:
    """Make `device` the calling thread's current CUDA device (a no-op off CUDA).

    Every thread that touches a GPU calls it first: allocations, streams, events and NCCL
    calls without an explicit device go to the current one, which starts as cuda:0."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index if dev.index is not None else 0)


def _cuda_index(world: World) -> int | None:
    dev = torch.device(world.device)
    if dev.type != "cuda":
        return None
    return dev.index if dev.index is not None else 0


@dataclass(frozen=True)
class TargetRank:
    """An M:N run's target process: it captures features for the drafter ranks."""

    index: int  # among all target ranks (node-major)
    device: str
    layout: Layout
    process: int  # its rank in the whole launch


def layout_from_env(topology: TopologyConfig) -> Layout:
    """The M:N layout torchrun launched; a launch of the wrong size is a UserError."""
    n, m = len(topology.drafter_devices), len(topology.target_devices)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(size)))
    if local != n + m or size % local:
        raise UserError(
            f"topology.targets = 'shared': {n} drafter + {m} target device(s) need {n + m} "
            f"processes per node, this node has {local}: launch with "
            f"`torchrun --nproc-per-node {n + m} -m trainer ...`"
        )
    return Layout(n, m, size // local)


def init_world(topology: TopologyConfig) -> World | TargetRank:
    """Read torchrun's env; start the process group when there is more than one rank.

    On CUDA the rank's drafter device is bound first and given to NCCL (`device_id`), so the
    communicator is created eagerly on the right GPU. M:N (`topology.targets = "shared"`): a
    target process gets its `TargetRank` (no process group: `topology.init_links` connects
    it); drafter processes form the default group among themselves."""
    if topology.targets == "shared":
        return _init_shared(topology)
    size = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    devices = topology.drafter_devices
    device = devices[local_rank % len(devices)]
    if size <= 1:
        if torch.device(device).type == "cuda" and torch.cuda.is_available():
            bind_thread(device)  # the main thread builds the parts
        return World(device=device)
    rank = launch_rank()
    world = World(
        rank=rank,
        size=size,
        local_rank=local_rank,
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(size))),
        device=device,
        process=rank,  # every process trains: the drafter rank is the launch's
    )
    # a group node (dflashctl): ranks in the inventory's order, on an explicit store
    _init_group(world, launch_store() if node_rank() is not None else None)
    return world


def _init_group(world: World, store: Store | None = None) -> None:
    timeout = collective_timeout()
    ranks: dict[str, Any] = {} if store is None else {"rank": world.rank, "world_size": world.size}
    index = _cuda_index(world)
    if index is None:
        dist.init_process_group("gloo", timeout=timeout, store=store, **ranks)
        return
    if not torch.cuda.is_available():
        raise UserError(f"topology: device {world.device!r} requested but CUDA is unavailable")
    cuda = torch.device("cuda", index)
    bind_thread(cuda)
    dist.init_process_group("nccl", timeout=timeout, device_id=cuda, store=store, **ranks)


STORE_TIMEOUT = timedelta(minutes=10)
"""How long a launch-store client waits to connect, and for each operation, by default."""

COLLECTIVE_TIMEOUT_ENV = "DFLASH_COLLECTIVE_TIMEOUT_S"
"""The process group's timeout in seconds (a rank waiting longer in one collective fails; NCCL:
the watchdog aborts the communicator). dflashctl sets it from a group's stall_timeout_s."""


def collective_timeout(env: Mapping[str, str] | None = None) -> timedelta:
    """The process group's timeout: DFLASH_COLLECTIVE_TIMEOUT_S, else 10 minutes."""
    raw = (os.environ if env is None else env).get(COLLECTIVE_TIMEOUT_ENV, "")
    try:
        seconds = float(raw)
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        return timedelta(minutes=10)
    return timedelta(seconds=seconds)


# The launch store this process hosts (torchrun's RANK 0 when its agent does not share its own):
# kept for the life of the process, whose other ranks connect to it as clients.
_HOSTED: list[TCPStore] = []


class LaunchStoreError(UserError):
    """torchrun's store cannot be reached (or this process was not launched by torchrun)."""


def launch_store(timeout: timedelta = STORE_TIMEOUT) -> TCPStore:
    """A client of the launcher's rendezvous store (torchrun hosts it at MASTER_ADDR:MASTER_PORT),
    the one way this package opens it: for process groups that are not the launch's whole world,
    the M:N control keys, and who failed first. `timeout` bounds the connect and each operation.

    Not launched by torchrun (no MASTER_ADDR/MASTER_PORT), or the store unreachable within
    `timeout`: `LaunchStoreError`, one line naming MASTER_ADDR:MASTER_PORT. A caller that can do
    without the store catches it."""
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    if not addr or not port:
        raise LaunchStoreError(
            "torchrun's store: MASTER_ADDR/MASTER_PORT are not set (not launched by torchrun)"
        )
    where = f"MASTER_ADDR:MASTER_PORT = {addr}:{port}"
    try:
        number = int(port)
    except ValueError:
        raise LaunchStoreError(f"torchrun's store at {where}: the port is not a number") from None
    try:
        if _hosts_launch_store() and not _HOSTED:
            _HOSTED.append(
                TCPStore(
                    addr,
                    number,
                    is_master=True,
                    timeout=timeout,
                    multi_tenant=True,
                    wait_for_workers=False,
                )
            )
            return _HOSTED[0]
        return TCPStore(addr, number, is_master=False, timeout=timeout)
    except (RuntimeError, ValueError) as exc:  # DistNetworkError / DistStoreError: RuntimeErrors
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise LaunchStoreError(
            f"torchrun's store at {where} is unreachable within {timeout.total_seconds():g} s: "
            f"{reason}",
            hint="its torchrun is gone, or this node cannot reach MASTER_ADDR",
        ) from None


def _hosts_launch_store() -> bool:
    """Whether this process serves the launch store at MASTER_ADDR:MASTER_PORT: torchrun's
    RANK 0 when its agent does not share its own store with the workers (under c10d with
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 a worker hosts it, as env:// would)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return False
    return os.environ.get("RANK") == "0"


def _init_shared(topology: TopologyConfig) -> World | TargetRank:
    layout = layout_from_env(topology)
    process = launch_rank()
    node, local = divmod(process, layout.n + layout.m)
    if local >= layout.n:
        j = local - layout.n
        device = topology.target_devices[j]
        bind_thread(device)
        return TargetRank(node * layout.m + j, device, layout, process)
    world = World(
        rank=node * layout.n + local,
        size=layout.drafters,
        local_rank=local,
        local_size=layout.n,
        device=topology.drafter_devices[local],
        layout=layout,
        process=process,
    )
    bind_thread(world.device)
    if world.distributed:  # the drafters' own default group (the targets are not in it)
        _init_group(world, PrefixStore("dflash/drafters/", launch_store()))
    return world


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def sum_gradients(params: list[nn.Parameter], world: World) -> list[torch.Tensor]:
    """grad <- sum over ranks of grad, with one flat all-reduce (no host sync); returns the
    gradients (parameters without one are skipped, on every rank alike)."""
    grads = [p.grad for p in params if p.grad is not None]
    if grads and world.distributed:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
    return grads


def scale_gradients(grads: list[torch.Tensor], scale: float) -> None:
    """grad <- scale * grad (a host scalar: no sync)."""
    if grads:
        torch._foreach_mul_(grads, scale)


def reduce_gradients(params: list[nn.Parameter], world: World, scale: float) -> None:
    """grad <- scale * sum over ranks of grad, with one flat all-reduce."""
    scale_gradients(sum_gradients(params, world), scale)


def gather_objects(obj: Any, world: World) -> list[Any]:
    """Every rank's `obj`; on NCCL staged through this rank's own GPU (never cuda:0's)."""
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    index = _cuda_index(world)
    if index is None:
        dist.all_gather_object(out, obj)
    else:
        with torch.cuda.device(index):
            dist.all_gather_object(out, obj)
    return out


def barrier(world: World) -> None:
    """All ranks meet; on NCCL on this rank's GPU (`device_ids`), not the current device's."""
    if not world.distributed:
        return
    index = _cuda_index(world)
    if index is None:
        dist.barrier()
    else:
        with torch.cuda.device(index):
            dist.barrier(device_ids=[index])


def pick_devices(cfg: TrainConfig, world: World) -> tuple[torch.device, list[str]]:
    """This rank's drafter device and its share of the target devices."""
    topo = cfg.topology
    if len(topo.drafter_devices) not in (1, world.local_size):
        raise UserError(
            f"topology.drafter_devices has {len(topo.drafter_devices)} entries but "
            f"{world.local_size} rank(s) run on this node: launch with "
            f"`torchrun --nproc-per-node {len(topo.drafter_devices)} -m trainer ...`"
        )
    shared = world.local_size > 1 and len(topo.drafter_devices) == 1
    if shared and topo.drafter_devices[0].startswith("cuda"):
        raise UserError(
            f"topology.drafter_devices: {world.local_size} ranks would share "
            f"{topo.drafter_devices[0]}; list one device per rank"
        )
    drafter = topo.drafter_devices[world.local_rank % len(topo.drafter_devices)]
    targets = topo.target_devices
    if world.layout is not None:
        targets = []  # M:N: the target ranks capture; this rank receives (topology.py)
    elif len(targets) >= world.local_size:
        targets = targets[world.local_rank :: world.local_size]
    for dev in [drafter, *targets]:
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"topology: device {dev!r} requested but CUDA is unavailable")
    device = torch.device(drafter)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", 0)  # one name for it: tensors report cuda:0
    return device, list(targets)
