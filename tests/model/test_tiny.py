"""The tiny-target builders take `[model.tiny_target]` (TinyTarget), the one spelling of its shape."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from trainer.config import TinyTarget
from trainer.memory.measure import drafter_config
from trainer.memory.shapes import DrafterShape
from trainer.model.tiny import build_tiny_target, tiny_config, write_tiny_target


def test_tiny_config_follows_the_config_model() -> None:
    spec = TinyTarget(vocab_size=256, hidden_size=32, num_layers=3, num_heads=2, num_kv_heads=1)
    hf = tiny_config(spec)
    assert (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers) == (256, 32, 3)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (2, 1, 16)
    assert hf.intermediate_size == spec.intermediate_size and not hf.tie_word_embeddings


def test_keyword_form_is_the_config_model(tmp_path: Path) -> None:
    a = write_tiny_target(tmp_path / "a", TinyTarget(seed=3, num_layers=2))
    b = build_tiny_target(tmp_path / "b", seed=3, num_layers=2)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    with pytest.raises(ValidationError):
        build_tiny_target(tmp_path / "c", num_layer=2)  # a typo is refused, not ignored


def test_drafter_config_of_a_shape() -> None:
    shape = DrafterShape(64, 128, 2, 4, 2, 16, 512, 4, 3)
    cfg = drafter_config(shape)
    assert (cfg.target_layer_ids, cfg.num_target_layers, cfg.mask_token_id) == ([0, 1, 2], 6, 511)
    deep = drafter_config(shape, num_target_layers=36)
    assert len(deep.target_layer_ids) == 3 and deep.num_target_layers == 36
    assert (deep.hidden_size, deep.block_size, deep.vocab_size) == (64, 4, 512)
