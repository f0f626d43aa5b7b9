"""Drafter internals: the inference K/V cache and generality of target capture."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.model.helpers import make_batch, make_drafter
from trainer.model.drafter import DrafterCache
from trainer.model.target import TargetModel


def test_cached_drafting_equals_reprojecting_the_whole_context(target: TargetModel) -> None:
    """Feeding context in increments through DrafterCache gives the uncached block outputs."""
    drafter = make_drafter(target, block_size=4)
    ids, _loss, attn = make_batch(rows=1)
    feats = target.capture(ids, attn)
    cache = DrafterCache()
    done = 0
    with torch.no_grad():
        for upto in (5, 6, 11, 17):
            block = drafter.block_input_ids(ids[:, upto : upto + 1])
            pos = torch.arange(upto, upto + 4)[None]
            cached = drafter(feats[:, done:upto], block, pos, cache=cache)
            full = drafter(feats[:, :upto], block, pos)
            torch.testing.assert_close(cached, full, atol=1e-5, rtol=1e-5)
            done = upto
    assert cache.length == 17 and cache.layers[0][0].shape[2] == 17


def test_cache_refuses_a_training_mask(target: TargetModel) -> None:
    drafter = make_drafter(target, block_size=4)
    with pytest.raises(ValueError, match="inference"):
        drafter(
            torch.zeros(1, 2, 128),
            torch.zeros(1, 4, dtype=torch.long),
            torch.arange(2, 6)[None],
            mask=torch.ones(1, 1, 4, 6, dtype=torch.bool),
            cache=DrafterCache(),
        )


def test_capture_works_for_other_hf_decoders(tmp_path: Path) -> None:
    """Any HF causal LM with model.layers: a tiny Llama follows the same +1 convention."""
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    llama = TargetModel.load(tmp_path, [0, 2])
    ids = torch.randint(0, 64, (1, 9))
    with torch.no_grad():
        ref = llama.model(input_ids=ids, output_hidden_states=True).hidden_states
    torch.testing.assert_close(llama.capture(ids), torch.cat([ref[1], ref[3]], -1))
