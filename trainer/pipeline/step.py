"""One optimizer step of the drafter: `grad_accum` micro-batches forward and backward, the
step's all-reduce, then clip and AdamW (skipped when the loss is not finite).

One host sync per step: the gradients are summed over ranks unscaled and their norm is taken on
the device before anything is read; the step's sums, flags and that norm come back in one read
(`reduce.all_reduce_step`), and the normalisation (1 / global weight) and the clip coefficient
are then one host scalar applied to the gradients, as `clip_grad_norm_` would (its 1e-6 too).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor

from trainer.model.masks import sample_anchors
from trainer.model.split_step import bounded_objective_backward
from trainer.pipeline import distributed
from trainer.pipeline.build import Parts
from trainer.pipeline.reduce import (
    METRIC_KEYS,
    StepContribution,
    StepFlags,
    StepTotals,
    all_reduce_step,
)
from trainer.pipeline.stages import Packet


class Feed(Protocol):
    """Where the drafter's micro-batches come from, in sequence order, on its device
    (`stages.Stager`: a wait for data gives up with `Stopped` when the pipeline stops)."""

    def get(self) -> tuple[int, Packet]: ...

    def depth(self) -> int: ...  # packets waiting for the drafter (the status line's q_hs)


@dataclass(frozen=True)
class StepResult:
    step: int  # optimizer steps completed, this one included
    lr: float
    gnorm: float | None  # None: no update (non-finite loss, or nothing to learn from)
    totals: StepTotals  # every rank's sums and flags

    @property
    def finite(self) -> bool:
        return math.isfinite(self.totals.loss_sum)

    @property
    def loss(self) -> float | None:
        weight = self.totals.weight_sum
        return self.totals.loss_sum / weight if weight > 0 else None


def split_teacher(hidden: Tensor, width: int, distills: bool) -> tuple[Tensor, Tensor | None]:
    """A packet's features and, when the run distills, the target's last hidden state that
    rides after them (`stages.capture_batch(final=True)`): views, no copy."""
    if not distills:
        return hidden, None
    if hidden.shape[-1] <= width:
        raise ValueError(
            f"features of width {hidden.shape[-1]} carry no last hidden state after the "
            f"{width} captured ones (kd_weight > 0)"
        )
    return hidden[..., :width], hidden[..., width:]


def _poison(loss: torch.Tensor) -> torch.Tensor:
    """DFLASH_FAULT's non-finite step: a NaN loss (and NaN gradients) for every piece."""
    return loss * float("nan")


def autocast_for(device: torch.device) -> contextlib.AbstractContextManager[object]:
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def train_step(
    p: Parts,
    feed: Feed,
    step: int,
    flags: Callable[[], StepFlags],
    autocast: contextlib.AbstractContextManager[object],
) -> StepResult:
    """Optimizer step `step` (0-based); raises `Stopped` when the pipeline stops mid-step.

    `flags` is read after the micro-batches, right before the reduce: a stop asked during the
    step takes effect at its end, on every rank."""
    o, m = p.cfg.optimizer, p.cfg.model
    dev, nb = p.drafter_device, p.sampler.num_buckets
    lr = p.schedule.lr(step)
    for group in p.opt.param_groups:
        group["lr"] = math.inf if p.faults.inf_lr_at(step) else lr
    sums = torch.zeros(len(METRIC_KEYS), dtype=torch.float64, device=dev)
    bucket_sums = torch.zeros(2 * nb, dtype=torch.float64, device=dev)
    for _ in range(o.grad_accum):
        seq, pkt = feed.get()  # packet n-1 is dropped: at most n and n+1 on the device
        p.faults.tick("drafter")
        host = pkt.host_masks()  # the draw reads host copies: no wait on the drafter's device
        anchors = sample_anchors(
            host.loss_mask, host.attention_mask, m.num_anchors, p.gen, host.position_ids
        )
        width = p.dcfg.num_features * p.dcfg.hidden_size
        features, teacher = split_teacher(pkt.hidden, width, m.loss.distills)
        # forward+backward in pieces of <= m.max_query_rows query rows (None: one)
        res = bounded_objective_backward(
            p.drafter,
            pkt.input_ids,
            pkt.loss_mask,
            pkt.attention_mask,
            features,
            max_query_rows=m.max_query_rows,
            num_anchors=m.num_anchors,
            gamma=m.gamma,
            noise=m.noise,
            generator=p.gen,
            attn_backend=m.attention,
            autocast=autocast,
            loss_transform=_poison if p.faults.nonfinite_at(step) else None,
            position_ids=pkt.position_ids,
            anchors=anchors,
            host_masks=(host.loss_mask, host.attention_mask, host.position_ids),
            loss=m.loss,
            teacher=teacher,
        )
        sums += torch.stack([getattr(res, k).detach().to(torch.float64) for k in METRIC_KEYS])
        if nb > 1:  # this rank's batch of seq comes from one length bucket
            i = 2 * p.plan.batch(seq).bucket
            pair = torch.stack([res.loss_sum.detach(), res.weight_sum.detach()])
            bucket_sums[i : i + 2] += pair.to(torch.float64)
        del pkt, res, features, teacher
    mine = StepContribution(sums, bucket_sums, flags(), feed.depth())
    grads = distributed.sum_gradients(p.params, p.world)  # unscaled: W is not known yet
    raw_norm = (
        torch.nn.utils.get_total_norm(grads)
        if grads
        else torch.zeros((), dtype=torch.float32, device=dev)
    )
    totals, (raw,) = all_reduce_step(mine, p.world, local=raw_norm)
    gnorm: float | None = None
    if math.isfinite(totals.loss_sum) and totals.weight_sum > 0:
        scale = 1.0 / totals.weight_sum
        gnorm = raw * scale  # the norm of the normalised gradient
        max_norm = o.clip if o.clip > 0 else math.inf
        coef = min(1.0, max_norm / (gnorm + 1e-6))  # clip_grad_norm_'s coefficient
        distributed.scale_gradients(grads, scale * coef)
        p.opt.step()
    p.opt.zero_grad(set_to_none=True)
    return StepResult(step + 1, lr, gnorm, totals)
