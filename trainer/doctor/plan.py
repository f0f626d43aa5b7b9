"""What the doctor tests, read from the run config without torch: the devices and the drafter's
attention shape (the target's config.json, or `model.tiny_target` before it is built)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from trainer.config import ConfigError, TrainConfig
from trainer.errors import TrainerError


class DoctorConfigError(TrainerError, ValueError):
    """The config or the target's shape cannot be read: one line naming the file and key."""


@dataclass(frozen=True)
class DrafterFacts:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    num_anchors: int
    attention: str  # model.attention


@dataclass(frozen=True)
class DoctorPlan:
    config: Path
    drafter_devices: tuple[str, ...]
    target_devices: tuple[str, ...]
    drafter: DrafterFacts

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device once, drafters first, in the config's order."""
        return tuple(dict.fromkeys((*self.drafter_devices, *self.target_devices)))

    @property
    def cuda_drafters(self) -> tuple[str, ...]:
        return tuple(d for d in self.drafter_devices if d.startswith("cuda"))


def canonical(device: str) -> str:
    """ "cuda" -> "cuda:0" (what torch binds), everything else as written."""
    return "cuda:0" if device == "cuda" else device


def load_plan(config: Path) -> DoctorPlan:
    if not config.is_file():
        raise DoctorConfigError(f"{config}: no such config file")
    try:
        cfg = TrainConfig.load(config)
    except ConfigError as exc:
        raise DoctorConfigError(str(exc).splitlines()[0]) from None
    return DoctorPlan(
        config,
        tuple(canonical(d) for d in cfg.topology.drafter_devices),
        tuple(canonical(d) for d in cfg.topology.target_devices),
        _drafter_facts(cfg),
    )


def _drafter_facts(cfg: TrainConfig) -> DrafterFacts:
    d, m = cfg.model.drafter, cfg.model
    heads, kv_heads, head_dim = _target_attention(cfg)
    return DrafterFacts(
        heads=d.num_attention_heads or heads,
        kv_heads=d.num_key_value_heads or kv_heads,
        head_dim=d.head_dim or head_dim,
        block_size=d.block_size,
        num_anchors=m.num_anchors,
        attention=m.attention,
    )


def _target_attention(cfg: TrainConfig) -> tuple[int, int, int]:
    """(heads, kv heads, head_dim) of the target: its config.json, else `model.tiny_target`."""
    from trainer.memory.shapes import MemoryEstimateError, read_target_shape

    target_dir = cfg.resolve(cfg.model.target_dir)
    tiny = cfg.model.tiny_target
    if not (target_dir / "config.json").is_file() and tiny is not None:
        return tiny.num_heads, tiny.num_kv_heads, tiny.head_dim
    try:
        shape = read_target_shape(target_dir)
    except MemoryEstimateError as exc:
        raise DoctorConfigError(str(exc)) from None
    return shape.heads, shape.kv_heads, shape.head_dim
