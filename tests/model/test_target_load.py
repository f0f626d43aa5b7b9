"""`load_causal_lm` builds the same model as transformers' own `from_pretrained(dtype=...)`.

The loader asks transformers for the process default dtype and builds the parameters in the
wanted one under a per-thread torch function mode; transformers then casts each checkpoint tensor
to the built parameter's dtype. If a transformers version stopped doing that, or built a
parameter or buffer the mode does not reach, a dtype or a value here would differ.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, PreTrainedModel

from trainer.model.target_load import load_causal_lm


def _reference(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        path, dtype=dtype, local_files_only=True, attn_implementation="sdpa"
    )
    return model


def _assert_same(got: PreTrainedModel, want: PreTrainedModel) -> None:
    for kind in ("named_parameters", "named_buffers"):
        g, w = dict(getattr(got, kind)()), dict(getattr(want, kind)())
        assert g.keys() == w.keys(), kind
        for name, tensor in w.items():
            assert g[name].dtype == tensor.dtype, name
            assert torch.equal(g[name], tensor), name


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    out = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(out)
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("which", ["qwen3", "llama"])
def test_load_equals_transformers_own_load(
    which: str, dtype: torch.dtype, tiny_dir: Path, llama_dir: Path
) -> None:
    path = tiny_dir if which == "qwen3" else llama_dir
    got = load_causal_lm(path, dtype)
    assert {p.dtype for p in got.parameters()} == {dtype}
    assert got.config.dtype == dtype
    _assert_same(got, _reference(path, dtype))
    assert torch.get_default_dtype() == torch.float32
