"""A tiny Qwen3 whose greedy continuation is a bigram chain, wired by hand: a target a small
drafter can really learn, so a drafter distilled from it accepts on prompts it never saw.

The random target's greedy text is a function of its whole context that a drafter trained for
minutes on CPU barely learns (tau ~1.1). This one, in the shapes vLLM's CPU attention takes
(hidden 256, 4 heads of 64, 2 KV heads, 4 layers) with Qwen3's real vocabulary and tokenizer,
continues any prompt of its `ALPHABET` tokens with `successor(last token)`, then that token's
successor, and so on: every token of the alphabet has a dimension of its own in the embedding,
the LM head maps it to its successor (a seeded permutation), and every layer is zero, so each
hidden state the drafter is conditioned on is the current token's. The mask token has a
dimension of its own too (a zero embedding would give every mask slot the same query).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

VOCAB = 151_936
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 4, 2, 64, 4
ALPHABET_SIZE = 64
MASK_DIM = 200  # the mask token's own dimension (past the alphabet's)
SUCCESSOR = 10.0  # the LM-head weight from a token's dimension to its successor
IM_END, ENDOFTEXT = 151645, 151643
SEED = 0


def alphabet() -> np.ndarray:
    """The tokens the target continues (seeded ids of ordinary text tokens)."""
    rng = np.random.default_rng(SEED)
    return rng.choice(np.arange(1_000, 150_000), size=ALPHABET_SIZE, replace=False)


def successors() -> dict[int, int]:
    """token -> the token the target says after it (a permutation of the alphabet)."""
    tokens = alphabet()
    order = np.random.default_rng(SEED + 1).permutation(ALPHABET_SIZE)
    return {int(tokens[i]): int(tokens[order[i]]) for i in range(ALPHABET_SIZE)}


def bigram_config() -> Qwen3Config:
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        max_position_embeddings=4096,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=[IM_END, ENDOFTEXT],
        pad_token_id=None,
    )


def _wire(model: Qwen3ForCausalLM, mask_token_id: int) -> None:
    for param in model.parameters():
        param.zero_()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    dim = {int(token): k for k, token in enumerate(alphabet())}
    for token, after in successors().items():
        embed[token, dim[token]] = 1.0
        head[after, dim[token]] = SUCCESSOR
    embed[mask_token_id, MASK_DIM] = 1.0


def build_bigram_target(out: Path, tokenizer_dir: Path, mask_token_id: int) -> Path:
    """Write the bigram target (fp32 safetensors) with Qwen3's tokenizer files into `out`."""
    model = Qwen3ForCausalLM(bigram_config())
    with torch.no_grad():
        _wire(model, mask_token_id)
    model.train(False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [IM_END, ENDOFTEXT]}))
    return out
