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

from pathlib import Path

import numpy as np
import torch
from transformers import Qwen3ForCausalLM

from tests.serving.scripted_target import save_wired, wired_config, zero_but_norms

VOCAB = 151_936
LAYERS = 4
ALPHABET_SIZE = 64
MASK_DIM = 200  # the mask token's own dimension (past the alphabet's)
SUCCESSOR = 10.0  # the LM-head weight from a token's dimension to its successor
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


def _wire(model: Qwen3ForCausalLM, mask_token_id: int) -> None:
    zero_but_norms(model)
    embed, head = model.model.embed_tokens.weight, model.lm_head.weight
    dim = {int(token): k for k, token in enumerate(alphabet())}
    for token, after in successors().items():
        embed[token, dim[token]] = 1.0
        head[after, dim[token]] = SUCCESSOR
    embed[mask_token_id, MASK_DIM] = 1.0


def build_bigram_target(out: Path, tokenizer_dir: Path, mask_token_id: int) -> Path:
    """Write the bigram target (fp32 safetensors) with Qwen3's tokenizer files into `out`."""
    model = Qwen3ForCausalLM(wired_config(LAYERS))
    with torch.no_grad():
        _wire(model, mask_token_id)
    return save_wired(model, out, tokenizer_dir)
