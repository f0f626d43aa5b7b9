"""Data parallelism without a DDP wrapper: each rank sums its unnormalised gradients and one
all-reduce of a flat buffer adds them; the caller divides by the GLOBAL weight sum, so the loss
is an exact token-weighted mean over every micro-batch of every rank (grad accumulation and
rank count do not change the result). Launched by torchrun (env://); gloo on CPU, NCCL on GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.config import TrainConfig
from trainer.pipeline.assets import UserError


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0
    local_size: int = 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.size > 1


def init_world(drafter_device_type: str) -> World:
    """Read torchrun's env; start the process group when there is more than one rank."""
    size = int(os.environ.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World()
    world = World(
        rank=int(os.environ["RANK"]),
        size=size,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        local_size=int(os.environ.get("LOCAL_WORLD_SIZE", str(size))),
    )
    backend = "nccl" if drafter_device_type == "cuda" else "gloo"
    dist.init_process_group(backend, timeout=timedelta(minutes=10))
    return world


def close_world(world: World) -> None:
    if world.distributed and dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(t: torch.Tensor, world: World) -> torch.Tensor:
    if world.distributed:
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def reduce_gradients(params: list[nn.Parameter], world: World, scale: float) -> None:
    """grad <- scale * sum over ranks of grad, with one flat all-reduce."""
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return
    if world.distributed:
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        offset = 0
        for g in grads:
            n = g.numel()
            g.copy_(flat[offset : offset + n].view_as(g))
            offset += n
    for g in grads:
        g.mul_(scale)


def gather_objects(obj: Any, world: World) -> list[Any]:
    if not world.distributed:
        return [obj]
    out: list[Any] = [None] * world.size
    dist.all_gather_object(out, obj)
    return out


def barrier(world: World) -> None:
    if world.distributed:
        dist.barrier()


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
    if len(targets) >= world.local_size:
        targets = targets[world.local_rank :: world.local_size]
    for dev in [drafter, *targets]:
        if dev.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"topology: device {dev!r} requested but CUDA is unavailable")
    return torch.device(drafter), list(targets)
