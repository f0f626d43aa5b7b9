"""Before the first step: will flex_attention compile here? If not, SDPA, said once.

The drafter's step would use flex (`model.attention` = auto on CUDA, or flex): one probe call at
the drafter's real shape (`trainer.model.flex_probe`). A failure disables flex for the process
(`attention.disable_flex`), so every step and eval attends with SDPA and a dense mask: the same
sums, more memory and slower steps. One WARNING line names the device, the failure and that
cost, with the memory estimator's drafter peak for both backends at this config's
`model.max_query_rows` (`python -m trainer.memory`). Without it the first backward raised, the
supervisor restarted three times and gave up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from trainer.config import TrainConfig
from trainer.memory.costs import Backend
from trainer.model.attention import disable_flex, resolve_backend
from trainer.model.flex_probe import AttentionShape, ProbeFailure, probe
from trainer.pipeline.build import Parts

GIB = 1024**3


def choose_attention(p: Parts, warn: Callable[[str], None]) -> str:
    """ "flex" when the step will use flex and it ran; "sdpa" otherwise (warned when it fell)."""
    dev = p.drafter_device
    if resolve_backend(p.cfg.model.attention, dev) != "flex":
        return "sdpa"
    d = p.dcfg
    shape = AttentionShape(d.num_attention_heads, d.num_key_value_heads, d.head_dim, d.block_size)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32  # the step's autocast dtype
    failure = probe(shape, dev, dtype)
    if failure is None:
        return "flex"
    disable_flex(failure.line())
    warn(fallback_line(dev, failure, memory_cost(p.cfg)))
    return "sdpa"


def device_name(dev: torch.device) -> str:
    if dev.type != "cuda":
        return str(dev)
    props = torch.cuda.get_device_properties(dev)
    return f"{dev} ({props.name}, sm_{props.major}{props.minor})"


def fallback_line(dev: torch.device, failure: ProbeFailure, memory: str) -> str:
    return (
        f"flex_attention failed on {device_name(dev)} ({failure.line()}); the drafter attends "
        f"with SDPA from here on: the same loss, but dense masks (no tile skipping: slower "
        f"steps) and more memory: {memory}"
    )


def memory_cost(cfg: TrainConfig) -> str:
    """The estimator's drafter peak with SDPA against flex, or why there is none."""
    try:
        sdpa, flex = _drafter_peak(cfg, "sdpa"), _drafter_peak(cfg, "flex")
    except Exception as exc:  # the estimate is advice: never a reason to stop the run
        return f"no memory estimate ({type(exc).__name__}: {exc})"
    budget = cfg.model.max_query_rows
    at = f"model.max_query_rows = {budget}" if budget else "unbounded model.max_query_rows"
    return (
        f"drafter peak ~{sdpa / GIB:.2f} GiB with SDPA against ~{flex / GIB:.2f} GiB with flex "
        f"at {at} (python -m trainer.memory; lower model.max_query_rows after an OOM)"
    )


def _drafter_peak(cfg: TrainConfig, backend: Backend) -> int:
    """As `python -m trainer.memory` prices it, with `backend` (SDPA unpacks packed rows)."""
    from trainer.memory.batches import batch_shapes
    from trainer.memory.estimate import Estimator, Precision, precision_for
    from trainer.memory.shapes import drafter_shape, read_target_shape

    target = read_target_shape(cfg.resolve(cfg.model.target_dir))
    base = precision_for(cfg)
    shapes = batch_shapes(cfg, unpack=backend == "sdpa")
    est = Estimator(
        cfg,
        target,
        drafter_shape(cfg, target),
        shapes,
        Precision(base.compute, base.features, backend),
    )
    peak, _ = est.drafter_peak(cfg.model.max_query_rows)
    return peak
