"""Build the parts of a run, in one function: store, held-out rows, sampler and plan, schedule,
drafter, optimizer and RNG. Everything a user can get wrong here is a `UserError` (one line)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from trainer.config import TrainConfig
from trainer.config.schedule import lr_at, warmup_steps_for
from trainer.data.store import TokenStore
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.pipeline import assets, distributed
from trainer.pipeline.faults import FaultPlan
from trainer.pipeline.plan import BatchPlan
from trainer.sampler import BatchSampler


@dataclass(frozen=True)
class RunOptions:
    """What `python -m trainer` was asked to do."""

    config: Path
    run_dir: Path
    resume: str = "auto"  # "auto" | "never" | a checkpoint path | a step number
    fresh: bool = False


@dataclass(frozen=True)
class Schedule:
    """The optimizer steps of the whole plan, where this run ends, and the LR over them."""

    total_steps: int
    end_step: int  # total_steps, or schedule.max_steps when that is sooner
    warmup_steps: int
    peak: float
    floor: float

    def lr(self, step: int) -> float:
        return lr_at(
            step,
            total_steps=self.total_steps,
            warmup_steps=self.warmup_steps,
            peak=self.peak,
            floor=self.floor,
        )

    def state_dict(self) -> dict[str, int]:
        return {"total_steps": self.total_steps, "warmup_steps": self.warmup_steps}


@dataclass
class Parts:
    """What one rank trains with (built by `build_parts`, loaded from a checkpoint on resume)."""

    cfg: TrainConfig
    world: distributed.World
    run_dir: Path
    faults: FaultPlan
    store: TokenStore
    holdout: np.ndarray  # held-out row ids (never trained on)
    sampler: BatchSampler
    plan: BatchPlan
    schedule: Schedule
    target_dir: Path
    layer_ids: list[int]
    target_dtype: torch.dtype
    drafter_device: torch.device
    target_devices: list[str]
    dcfg: DrafterConfig
    drafter: DFlashDrafter
    params: list[torch.nn.Parameter]
    opt: torch.optim.AdamW
    gen: torch.Generator  # the anchor sampler's RNG (per rank)

    @property
    def accum(self) -> int:
        return self.cfg.optimizer.grad_accum


def target_dtype(cfg: TrainConfig, drafter_device: torch.device) -> torch.dtype:
    name = cfg.topology.target_dtype
    if name != "auto":
        dtype = getattr(torch, name)
        assert isinstance(dtype, torch.dtype)
        return dtype
    return torch.bfloat16 if drafter_device.type == "cuda" else torch.float32


def _data(
    cfg: TrainConfig, world: distributed.World, store: TokenStore
) -> tuple[np.ndarray, BatchSampler]:
    from trainer.buckets import PlanError, sampler_for
    from trainer.sampler import SamplerError, holdout_rows

    lengths = np.asarray(store.lengths, dtype=np.int64)
    try:  # the held-out rows: a pure function of (rows, count, seed), never trained on
        holdout = holdout_rows(len(lengths), cfg.eval.holdout_rows, cfg.seed)
    except SamplerError as exc:
        raise assets.UserError(f"eval.holdout_rows: {exc}") from None
    try:
        sampler = sampler_for(
            cfg.batching,
            lengths,
            seed=cfg.seed,
            rank=world.rank,
            world_size=world.size,
            exclude=holdout,
            max_length=store.manifest.max_length,  # packed rows' default row_length
        )
    except (PlanError, SamplerError) as exc:
        raise assets.UserError(f"batching: {store.name_rows(str(exc))}") from None
    return holdout, sampler


def _open_store(cfg: TrainConfig) -> TokenStore:
    from trainer.data.store import StoreError

    try:
        return TokenStore.open(assets.ensure_store(cfg))
    except StoreError as exc:
        raise assets.UserError(f"data.store: {exc}") from None


def plans_for(cfg: TrainConfig, drafters: int) -> tuple[TokenStore, list[BatchPlan]]:
    """The store and every drafter rank's plan (an M:N target rank captures for all of them:
    the same plans the drafter ranks build, a pure function of the seed and the rank)."""
    store = _open_store(cfg)
    plans = []
    for d in range(drafters):
        _, sampler = _data(cfg, distributed.World(rank=d, size=drafters), store)
        plans.append(BatchPlan(sampler, cfg.schedule.epochs))
    return store, plans


def _schedule(cfg: TrainConfig, plan: BatchPlan) -> Schedule:
    accum = cfg.optimizer.grad_accum
    total = plan.total // accum
    if total < 1:
        raise assets.UserError(
            f"schedule: {plan.total} micro-batches per rank cannot make one optimizer "
            f"step with optimizer.grad_accum={accum}"
        )
    s = cfg.schedule
    return Schedule(
        total_steps=total,
        end_step=min(total, s.max_steps or total),
        warmup_steps=warmup_steps_for(total, s.warmup_steps, s.warmup_ratio),
        peak=cfg.optimizer.lr,
        floor=s.min_lr,
    )


def build_parts(
    cfg: TrainConfig, world: distributed.World, run_dir: Path, faults: FaultPlan
) -> Parts:
    """Everything one rank trains with, fresh (weights from the seed, no step taken)."""
    drafter_device, target_devices = distributed.pick_devices(cfg, world)
    if world.local_rank == 0:  # each node's first process builds what the config makes there
        # (a synthetic store, a tiny target): nodes share no storage, so every node needs its
        # own; both builds publish by rename, so nodes that do share a directory cannot clash
        assets.ensure_store(cfg)
        assets.ensure_target(cfg)
    distributed.barrier(world)
    store, target_dir = _open_store(cfg), assets.ensure_target(cfg)
    holdout, sampler = _data(cfg, world, store)
    plan = BatchPlan(sampler, cfg.schedule.epochs)
    schedule = _schedule(cfg, plan)

    hf = assets.target_hf_config(target_dir)
    layer_ids = assets.layer_ids_for(cfg, hf)
    dcfg = assets.drafter_config(cfg, hf, layer_ids)
    dtype = target_dtype(cfg, drafter_device)
    borrowed = assets.load_borrowed(target_dir, hf, drafter_device, dtype)
    drafter = assets.build_drafter(
        dcfg,
        borrowed,
        drafter_device,
        cfg.seed,
        checkpoint_layers=cfg.model.drafter.checkpoint_layers,
    )
    params = [p for p in drafter.parameters() if p.requires_grad]
    o = cfg.optimizer
    opt = torch.optim.AdamW(params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    return Parts(
        cfg=cfg,
        world=world,
        run_dir=run_dir,
        faults=faults,
        store=store,
        holdout=holdout,
        sampler=sampler,
        plan=plan,
        schedule=schedule,
        target_dir=target_dir,
        layer_ids=layer_ids,
        target_dtype=dtype,
        drafter_device=drafter_device,
        target_devices=target_devices,
        dcfg=dcfg,
        drafter=drafter,
        params=params,
        opt=opt,
        gen=torch.Generator().manual_seed(cfg.seed * 1_000_003 + world.rank),
    )
