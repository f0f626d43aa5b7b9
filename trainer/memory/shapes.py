"""Shapes the memory estimate needs, read without torch: the target's config.json and the drafter.

The drafter's width, heads and vocabulary are the target's unless `model.drafter` overrides them
(as `trainer.pipeline.assets.drafter_config` builds it); features = captured layers (the config's
`model.target_layer_ids`, else one per drafter layer, the DFlash rule).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.config import TrainConfig
from trainer.errors import TrainerError


class MemoryEstimateError(TrainerError, ValueError):
    """A user-fixable problem; the message is one line naming the file and key."""


@dataclass(frozen=True)
class TargetShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool

    @property
    def params(self) -> int:
        """Qwen3-style decoder: embedding, layers (attention + SwiGLU + norms), norm, LM head."""
        h, q, kv = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim
        layer = h * q * 2 + h * kv * 2 + 3 * h * self.intermediate + 2 * h + 2 * self.head_dim
        head = 0 if self.tied else self.vocab * h
        return self.vocab * h + self.layers * layer + h + head


@dataclass(frozen=True)
class DrafterShape:
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    block: int
    features: int  # captured target layers concatenated into fc's input

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def linear_params(self) -> int:
        """Weights of the linears (the ones autocast caches a bf16 copy of)."""
        h, q, kv = self.hidden, self.q_width, self.kv_width
        layer = h * q * 2 + h * kv * 2 + 3 * h * self.intermediate
        return self.features * h * h + self.layers * layer

    @property
    def params(self) -> int:
        norms = self.layers * (2 * self.hidden + 2 * self.head_dim) + 2 * self.hidden
        return self.linear_params + norms


_TARGET_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def read_target_shape(path: Path) -> TargetShape:
    """The target's shape from `path` (a config.json or the model directory holding one)."""
    file = path / "config.json" if path.is_dir() else path
    try:
        raw: Any = json.loads(file.read_text())
    except FileNotFoundError:
        raise MemoryEstimateError(f"{file}: model.target_dir: no config.json there") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MemoryEstimateError(f"{file}: unreadable target config: {exc}") from None
    if isinstance(raw, dict) and isinstance(raw.get("text_config"), dict):
        raw = {**raw, **raw["text_config"]}
    if not isinstance(raw, dict):
        raise MemoryEstimateError(f"{file}: target config is not a JSON object")
    for key in (*_TARGET_KEYS, "vocab_size"):
        if not isinstance(raw.get(key), int) or raw[key] < 1:
            raise MemoryEstimateError(f"{file}: {key}: missing or not a positive integer")
    heads = raw["num_attention_heads"]
    kv = raw.get("num_key_value_heads") or heads
    head_dim = raw.get("head_dim") or raw["hidden_size"] // heads
    return TargetShape(
        hidden=raw["hidden_size"],
        intermediate=raw["intermediate_size"],
        layers=raw["num_hidden_layers"],
        heads=heads,
        kv_heads=int(kv),
        head_dim=int(head_dim),
        vocab=raw["vocab_size"],
        tied=bool(raw.get("tie_word_embeddings", False)),
    )


def drafter_shape(cfg: TrainConfig, target: TargetShape) -> DrafterShape:
    d = cfg.model.drafter
    ids = cfg.model.target_layer_ids
    return DrafterShape(
        hidden=target.hidden,
        intermediate=d.intermediate_size or target.intermediate,
        layers=d.num_layers,
        heads=d.num_attention_heads or target.heads,
        kv_heads=d.num_key_value_heads or target.kv_heads,
        head_dim=d.head_dim or target.head_dim,
        vocab=target.vocab,
        block=d.block_size,
        features=len(ids) if ids is not None else d.num_layers,
    )
