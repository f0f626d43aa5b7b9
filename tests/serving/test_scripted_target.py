"""The scripted target says what it was wired to say (under transformers, no engine): the
regeneration tests read the engine's replies against these texts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.serving.scripted_target import (
    ANSWER_TEXT,
    REASONING_TEXT,
    TOOL_NAME,
    build_scripted_target,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": TOOL_NAME,
            "description": "Current weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = f'<tool_call>{{"name":"{TOOL_NAME}","arguments":{{"city": "Paris"}}}}</tool_call>'
THINK = f"<think>{REASONING_TEXT}</think>\n\n"
ASKED = [{"role": "user", "content": "weather?"}]
ANSWERED = [
    *ASKED,
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": TOOL_NAME, "arguments": {}}}],
    },
    {"role": "tool", "content": "sunny"},
]


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory, qwen3_tokenizer_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = build_scripted_target(tmp_path_factory.mktemp("scripted"), qwen3_tokenizer_dir)
    tok = AutoTokenizer.from_pretrained(str(path))
    return tok, AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)


@pytest.mark.parametrize(
    ("messages", "tools", "thinking", "reply"),
    [
        (ASKED, None, True, THINK + ANSWER_TEXT),
        (ASKED, None, False, ANSWER_TEXT),
        (ASKED, TOOLS, True, THINK + CALL),
        (ASKED, TOOLS, False, CALL),
        (ANSWERED, TOOLS, False, ANSWER_TEXT),
        (ANSWERED, TOOLS, True, THINK + ANSWER_TEXT),
    ],
    ids=["think", "plain", "think-call", "call", "after-result", "think-after-result"],
)
def test_greedy_replies_are_the_wired_ones(
    scripted: Any, messages: list[dict[str, Any]], tools: Any, thinking: bool, reply: str
) -> None:
    tok, model = scripted
    kwargs = {} if thinking else {"enable_thinking": False}
    ids = tok.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, return_dict=True, **kwargs
    )["input_ids"]
    prompt = torch.tensor([ids])
    out = model.generate(prompt, max_new_tokens=40, do_sample=False)
    assert tok.decode(out[0, prompt.shape[1] :]) == reply + "<|im_end|>"
