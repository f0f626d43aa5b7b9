"""What a run config asks of a container (pure): the GPUs it names, its local ranks, the host
memory its buffers take and the shared memory NCCL needs.

Host buffers: every prefetch queue full (`topology.prefetch_depth` per bucket) plus the q_hs
buffer (`topology.hidden_depth`) and two packets in the drafter's hands, each a full token
budget of int64 ids, loss mask, attention mask and position ids, plus 4 GiB per local process
for the interpreter, torch and the CUDA context. /dev/shm: NCCL's intra-node transport keeps
its buffers there, so two or more CUDA ranks on a node need room (1 GiB; Docker's 64 MiB
default is the classic failure); a single rank needs none.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import TrainConfig

GIB = 1024**3
PROCESS_OVERHEAD = 4 * GIB
NCCL_SHM = GIB


@dataclass(frozen=True)
class Needs:
    gpu_indices: tuple[int, ...]  # CUDA indices the config names; () = a CPU run
    cuda_ranks: int  # CUDA processes on this node (drafter ranks + shared target ranks)
    host_bytes: int
    shm_bytes: int
    keep_last: int

    @property
    def gpus(self) -> int:
        return max(self.gpu_indices) + 1 if self.gpu_indices else 0


def cuda_index(device: str) -> int | None:
    if device == "cuda":
        return 0
    if device.startswith("cuda:") and device[5:].isdigit():
        return int(device[5:])
    return None


def needs_of(cfg: TrainConfig) -> Needs:
    topo = cfg.topology
    devices = [*topo.drafter_devices, *topo.target_devices]
    indices = sorted({i for i in (cuda_index(d) for d in devices) if i is not None})
    ranks = len(topo.drafter_devices) + (
        len(topo.target_devices) if topo.targets == "shared" else 0
    )
    cuda_ranks = ranks if indices else 0
    packets = topo.prefetch_depth * cfg.batching.num_buckets + topo.hidden_depth + 2
    buffers = packets * cfg.batching.token_budget * 4 * 8
    return Needs(
        gpu_indices=tuple(indices),
        cuda_ranks=cuda_ranks,
        host_bytes=buffers * max(ranks, 1) + PROCESS_OVERHEAD * max(ranks, 1),
        shm_bytes=NCCL_SHM if cuda_ranks >= 2 else 0,
        keep_last=cfg.checkpoint.keep_last,
    )


def needs_without_config(node_gpus: int) -> Needs:
    """No run config: every GPU the node drives, one rank."""
    return Needs(tuple(range(node_gpus)), 1 if node_gpus else 0, PROCESS_OVERHEAD, 0, 1)
