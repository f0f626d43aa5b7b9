"""A tiny Qwen3 whose greedy replies are written by hand: it thinks, calls a tool, and stops.

A random target never stops, never thinks and never calls a tool, so regeneration through a
real engine would test none of what it must get right. This one is wired, not trained, in the
shapes vLLM's CPU attention takes (hidden 256, 4 heads of 64, 2 KV heads, 2 layers), with Qwen3's
real vocabulary and tokenizer, so its greedy text is exactly:

* after ``<|im_start|>assistant\\n`` (a thinking-mode generation prompt):
  ``<think>Let me think</think>\\n\\n`` and then the answer below;
* after ``\\n\\n`` (the end of ``</think>\\n\\n``, and of the generation prompt with thinking
  off): ``Sure, done.<|im_end|>``, or, when the prompt carries tool definitions (the token
  ``tools`` of Qwen3's ``<tools>`` block) and no tool result yet (``<tool_response>``),
  ``<tool_call>{"name":"get_weather","arguments":{"city": "Paris"}}</tool_call><|im_end|>``.

How: every token the replies use has a dimension of its own in the embedding (all others share
none); the LM head maps each to its successor (a bigram chain). The one branch, after ``\\n\\n``,
reads two flags that layer 0's attention writes: head 0 attends only to ``tools`` tokens (its
key is non-zero only there, in the slowest RoPE pair, so position does not matter), head 2 only
to ``<tool_response>``; their values land in a flag dimension each. Everything else is zero.
"""

from __future__ import annotations

import json
import shutil
from itertools import pairwise
from pathlib import Path

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

THINK_OPEN, THINK_CLOSE = 151667, 151668
TOOL_CALL_OPEN, TOOL_CALL_CLOSE = 151657, 151658
TOOL_RESPONSE_OPEN = 151665
IM_END, ENDOFTEXT = 151645, 151643
NEWLINE, BLANK_LINE = 198, 271  # "\n", "\n\n"
TOOLS_WORD = 15918  # "tools", as in Qwen3's "<tools>" block

THINKING = (
    NEWLINE,
    THINK_OPEN,
    10061,
    752,
    1744,
    THINK_CLOSE,
    BLANK_LINE,
)  # <think>Let me think</think>\n\n
ANSWER = (BLANK_LINE, 39814, 11, 2814, 13, IM_END)  # Sure, done.
TOOL_CALL = (  # <tool_call>{"name":"get_weather","arguments":{"city": "Paris"}}</tool_call>
    BLANK_LINE,
    TOOL_CALL_OPEN,
    *(4913, 606, 3252, 455, 69364, 2198, 16370, 22317, 8926, 788, 330, 59604, 30975),
    TOOL_CALL_CLOSE,
    IM_END,
)
ANSWER_TEXT = "Sure, done."
REASONING_TEXT = "Let me think"
TOOL_NAME, TOOL_ARGUMENTS = "get_weather", {"city": "Paris"}

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, LAYERS = 256, 4, 2, 64, 2
VOCAB = 151_936
ONE, KEY_TOOLS, KEY_RESULT, FLAG_TOOLS, FLAG_RESULT = 100, 101, 102, 103, 104
ROPE_SLOW = HEAD_DIM // 2 - 1  # the slowest-rotating RoPE pair (31, 63): ~1e-4 rad a position
QK_GAIN = 3.0  # q/k norm weight on that dim: a trigger scores 72 against 0 elsewhere
SUCCESSOR, BRANCH = 10.0, 4.0  # LM-head weights: the chain's successor, and the flags' pull


def _chain_tokens() -> list[int]:
    seen: list[int] = []
    for token in (*THINKING, *ANSWER, *TOOL_CALL):
        if token not in seen:
            seen.append(token)
    return seen


def wired_config(num_layers: int) -> Qwen3Config:
    """A Qwen3 in the shapes vLLM's CPU attention takes, with Qwen3's vocabulary, to be wired by
    hand (this target, and tests/serving/bigram_target.py)."""
    return Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=512,
        num_hidden_layers=num_layers,
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


def scripted_config() -> Qwen3Config:
    return wired_config(LAYERS)


def zero_but_norms(model: Qwen3ForCausalLM) -> None:
    """Every weight 0, every norm weight 1: what the wiring starts from."""
    for param in model.parameters():
        param.zero_()
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)


def save_wired(model: Qwen3ForCausalLM, out: Path, tokenizer_dir: Path) -> Path:
    """Write a wired target (fp32 safetensors) with Qwen3's tokenizer files into `out`."""
    model.train(False)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(tokenizer_dir / name, out / name)
    generation = {"eos_token_id": [IM_END, ENDOFTEXT]}
    (out / "generation_config.json").write_text(json.dumps(generation) + "\n")
    return out


def _wire(model: Qwen3ForCausalLM) -> None:
    chain = _chain_tokens()
    dim = {token: k for k, token in enumerate(chain)}
    assert len(chain) < ONE
    zero_but_norms(model)
    embed = model.model.embed_tokens.weight
    embed[:, ONE] = 1.0
    for token, k in dim.items():
        embed[token, k] = 1.0
    embed[TOOLS_WORD, KEY_TOOLS] = 1.0
    embed[TOOL_RESPONSE_OPEN, KEY_RESULT] = 1.0
    attn = model.model.layers[0].self_attn
    for head, kv, key, flag in ((0, 0, KEY_TOOLS, FLAG_TOOLS), (2, 1, KEY_RESULT, FLAG_RESULT)):
        attn.q_proj.weight[head * HEAD_DIM + ROPE_SLOW, ONE] = 1.0
        attn.k_proj.weight[kv * HEAD_DIM + ROPE_SLOW, key] = 1.0
        attn.v_proj.weight[kv * HEAD_DIM, key] = 1.0
        # a trigger token's embedding has two unit entries: 16 / sqrt(2) after the RMS norm
        attn.o_proj.weight[flag, head * HEAD_DIM] = 2.0**0.5 / 16.0
    attn.q_norm.weight[ROPE_SLOW] = QK_GAIN
    attn.k_norm.weight[ROPE_SLOW] = QK_GAIN
    head = model.lm_head.weight
    for seq in (THINKING, ANSWER[1:], TOOL_CALL[1:]):
        for before, after in pairwise(seq):
            head[after, dim[before]] = SUCCESSOR
    head[ANSWER[1], dim[BLANK_LINE]] = SUCCESSOR + BRANCH / 2
    head[TOOL_CALL[1], dim[BLANK_LINE]] = SUCCESSOR
    head[TOOL_CALL[1], FLAG_TOOLS] = BRANCH
    head[TOOL_CALL[1], FLAG_RESULT] = -BRANCH


def build_scripted_target(out: Path, tokenizer_dir: Path) -> Path:
    """Write the scripted target (fp32 safetensors) with Qwen3's tokenizer files into `out`."""
    model = Qwen3ForCausalLM(scripted_config())
    with torch.no_grad():
        _wire(model)
    return save_wired(model, out, tokenizer_dir)
