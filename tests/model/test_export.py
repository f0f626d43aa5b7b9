"""Export in the z-lab layout and load back to identical logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.model.helpers import MASK_ID, make_batch, make_drafter
from trainer.model.export import ExportError, export_drafter, load_drafter
from trainer.model.target import TargetModel


def test_export_writes_zlab_config_and_drafter_only_weights(
    target: TargetModel, tmp_path: Path
) -> None:
    """config.json carries dflash_config; safetensors holds no embedding or LM head."""
    drafter = make_drafter(target, block_size=8, num_layers=2)
    out = export_drafter(drafter, tmp_path / "export")
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["block_size"] == 8 and cfg["num_target_layers"] == 8
    assert cfg["dflash_config"] == {"mask_token_id": MASK_ID, "target_layer_ids": [1, 5]}
    assert cfg["layer_types"] == ["full_attention", "full_attention"]
    keys = set(load_file(out / "model.safetensors"))
    assert {
        "fc.weight",
        "hidden_norm.weight",
        "norm.weight",
        "layers.1.self_attn.q_norm.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.0.mlp.gate_proj.weight",
        "layers.0.input_layernorm.weight",
        "layers.0.post_attention_layernorm.weight",
    } <= keys
    assert not any("embed" in k or "lm_head" in k for k in keys)
    assert not list(out.glob("*.tmp"))


def test_loaded_drafter_gives_identical_logits(target: TargetModel, tmp_path: Path) -> None:
    """Round trip: same weights, same config, same logits bit for bit."""
    drafter = make_drafter(target, block_size=4)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.01)  # not just the init
    loaded = load_drafter(export_drafter(drafter, tmp_path / "x"), target=target)
    ids, _loss, attn = make_batch(rows=1)
    feats = target.capture(ids, attn)
    block = drafter.block_input_ids(ids[:, 10:11])
    pos = torch.arange(10, 14)[None]
    with torch.no_grad():
        want = drafter.logits(drafter(feats[:, :10], block, pos))
        got = loaded.logits(loaded(feats[:, :10], block, pos))
    assert torch.equal(got, want)
    assert loaded.config == drafter.config


def test_load_refuses_a_target_with_other_capture_layers(
    target: TargetModel, tmp_path: Path
) -> None:
    """A drafter trained on layers [1, 5] must not silently read other layers."""
    out = export_drafter(make_drafter(target), tmp_path / "x")
    other = TargetModel(target.model, [2, 6])
    with pytest.raises(ExportError, match=r"\[1, 5\]"):
        load_drafter(out, target=other)


def test_load_names_the_broken_file(target: TargetModel, tmp_path: Path) -> None:
    """A config without dflash_config is reported with its path and the missing key."""
    out = export_drafter(make_drafter(target), tmp_path / "x")
    cfg = json.loads((out / "config.json").read_text())
    del cfg["dflash_config"]
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ExportError, match=r"config\.json: missing key 'dflash_config'"):
        load_drafter(out)
    with pytest.raises(ExportError, match="not a drafter export"):
        load_drafter(tmp_path / "nothing")
