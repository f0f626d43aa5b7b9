"""The one all-reduce of an optimizer step, packed and unpacked by name.

Each rank contributes its metric sums, four flags (a stop was asked, a timed checkpoint is due,
a timed evaluation is due, checkpoints keep failing), its reorder-buffer depth (in its own slot, so the sum is every
rank's depth) and its per-bucket (loss, weight) sums. One float64 tensor carries them, summed
over ranks, read back once per step (the step's one host sync): a flag is set when any rank
set it, so every rank takes the same decision at the same step.

The host-known part (flags, depths) goes up from pinned memory without a sync; values known only
after the reduce (the gradient norm) ride the same read (`all_reduce_step(..., local=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from trainer.pipeline import distributed

METRIC_KEYS = ("loss_sum", "weight_sum", "n_correct", "n_pred", "streak_sum", "n_blocks")


@dataclass(frozen=True)
class StepFlags:
    stop: bool = False  # a signal asked to stop
    checkpoint_due: bool = False  # checkpoint.every_minutes elapsed
    eval_due: bool = False  # eval.every_minutes elapsed
    checkpoints_failing: bool = False  # rank 0's checkpoint writes failed too often in a row

    def values(self) -> list[float]:
        return [
            float(self.stop),
            float(self.checkpoint_due),
            float(self.eval_due),
            float(self.checkpoints_failing),
        ]


_FLAGS = len(StepFlags().values())


@dataclass(frozen=True)
class StepTotals:
    """One step's figures summed over every rank."""

    metrics: dict[str, float]  # METRIC_KEYS -> sum
    flags: StepFlags  # any rank's flag
    depths: list[int]  # reorder-buffer depth, per rank
    bucket_sums: list[tuple[float, float]]  # (loss_sum, weight_sum) per length bucket

    @property
    def loss_sum(self) -> float:
        return self.metrics["loss_sum"]

    @property
    def weight_sum(self) -> float:
        return self.metrics["weight_sum"]

    @classmethod
    def unpack(cls, values: list[float], world_size: int, num_buckets: int) -> StepTotals:
        n = len(METRIC_KEYS)
        flags, at = values[n : n + _FLAGS], n + _FLAGS
        depths, at = values[at : at + world_size], at + world_size
        buckets = values[at : at + 2 * num_buckets]
        if len(buckets) != 2 * num_buckets:
            raise ValueError(f"a step reduce of {len(values)} values is short")
        return cls(
            metrics=dict(zip(METRIC_KEYS, values[:n], strict=True)),
            flags=StepFlags(*(f > 0 for f in flags)),
            depths=[int(d) for d in depths],
            bucket_sums=[(buckets[2 * j], buckets[2 * j + 1]) for j in range(num_buckets)],
        )


@dataclass(frozen=True)
class StepContribution:
    """What this rank adds to the step's reduce."""

    metrics: torch.Tensor  # float64 [len(METRIC_KEYS)], on the drafter's device
    bucket_sums: torch.Tensor  # float64 [2 * num_buckets]: loss_sum, weight_sum per bucket
    flags: StepFlags
    depth: int  # this rank's reorder-buffer depth

    def pack(self, world: distributed.World) -> torch.Tensor:
        dev = self.metrics.device
        depths = [0.0] * world.size
        depths[world.rank] = float(self.depth)
        host = torch.tensor(self.flags.values() + depths, dtype=torch.float64)
        if dev.type == "cuda":  # a pageable host->device copy would wait for the stream
            host = host.pin_memory().to(dev, non_blocking=True)
        return torch.cat([self.metrics, host, self.bucket_sums])


def read_back(t: torch.Tensor) -> list[float]:
    """A device tensor's values on the host: the step's one device->host sync."""
    return list(t.to("cpu").tolist())


def all_reduce_step(
    mine: StepContribution, world: distributed.World, local: torch.Tensor | None = None
) -> tuple[StepTotals, list[float]]:
    """Sum every rank's contribution; the one host sync of the step. `local` (this rank's
    values, not summed: e.g. the norm of the already reduced gradients) rides the same read;
    returns the totals and `local`'s values."""
    summed = distributed.all_reduce_sum(mine.pack(world), world)
    n = summed.numel()
    if local is not None:
        summed = torch.cat([summed, local.detach().reshape(-1).to(summed.dtype)])
    values = read_back(summed)
    totals = StepTotals.unpack(values[:n], world.size, len(mine.bucket_sums) // 2)
    return totals, values[n:]
