"""Content parts beyond text: LLaMA-Factory's v1 rows (`reasoning` and `tool_call` parts) import
through the real Qwen3 template with the same masks as `reasoning_content` and `tool_calls`, and
a part type nobody reads is named in the skip reason."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.data.conftest import write_jsonl
from trainer.data.chat_import import import_chat_jsonl, load_tokenizer
from trainer.data.conversations import BAD_SCHEMA, Conversation, Rejected, normalise_conversation
from trainer.data.store import TokenStore

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "llamafactory_reason_tool_use.jsonl"
END = "<|im_end|>"


def _supervised(tokenizer: Any, store: TokenStore, row: int) -> list[str]:
    tokens, mask = store.row(row)
    edges = np.flatnonzero(np.diff(np.concatenate([[0], mask.astype(np.int8), [0]])))
    return [
        tokenizer.decode(tokens[a:b].tolist()) for a, b in zip(edges[::2], edges[1::2], strict=True)
    ]


def _openai_form(row: dict[str, Any]) -> dict[str, Any]:
    """The same row written with `reasoning_content` and OpenAI `tool_calls` fields."""
    messages = []
    for m in row["messages"]:
        parts = m["content"]
        out: dict[str, Any] = {
            "role": m["role"],
            "content": "".join(p["value"] for p in parts if p["type"] == "text"),
        }
        thought = "".join(p["value"] for p in parts if p["type"] == "reasoning")
        if thought:
            out["reasoning_content"] = thought
        calls = [json.loads(p["value"]) for p in parts if p["type"] == "tool_call"]
        if calls:
            out["tool_calls"] = [{"type": "function", "function": c} for c in calls]
        messages.append(out)
    return {"messages": messages, "tools": row.get("tools")}


def test_llamafactory_reasoning_and_tool_call_parts_import_every_row(
    tmp_path: Path, qwen3_tokenizer_dir: Path
) -> None:
    """Every row of the v1 fixture is kept, and the store is byte for byte the one the same
    rows make in the OpenAI field form (`reasoning_content`, `tool_calls`)."""
    store_dir = tmp_path / "parts"
    manifest = import_chat_jsonl(FIXTURE, qwen3_tokenizer_dir, 4096, store_dir)
    rows = [json.loads(x) for x in FIXTURE.read_text().splitlines()]
    assert manifest.num_rows == len(rows) == 5 and manifest.skipped == {}
    assert manifest.params["reasoning_turns"] == 10
    fields = write_jsonl(tmp_path / "fields.jsonl", [_openai_form(r) for r in rows])
    twin = import_chat_jsonl(fields, qwen3_tokenizer_dir, 4096, tmp_path / "fields")
    assert {k: v.sha256 for k, v in twin.files.items()} == {
        k: v.sha256 for k, v in manifest.files.items()
    }


def test_llamafactory_parts_are_supervised_as_reasoning_and_tool_calls(
    tmp_path: Path, qwen3_tokenizer_dir: Path
) -> None:
    """Hand-checked masks: reasoning in its think block (Qwen3 keeps it on the turns after the
    last user message), each tool call part its own <tool_call>, text before a call kept; the
    system prompt, tool definitions, user turns and tool results never trained."""
    import_chat_jsonl(FIXTURE, qwen3_tokenizer_dir, 4096, tmp_path / "s")
    store = TokenStore.open(tmp_path / "s", verify=True)
    qwen3 = load_tokenizer(qwen3_tokenizer_dir)
    assert _supervised(qwen3, store, 2) == [
        "<think>\nTwo independent calls to square_root, x = 2 and x = 10.\n</think>\n\n"
        '<tool_call>\n{"name": "square_root", "arguments": {"x": 2}}\n</tool_call>\n'
        '<tool_call>\n{"name": "square_root", "arguments": {"x": 10}}\n</tool_call>' + END,
        "<think>\nBoth results are in; four decimals are enough.\n</think>\n\n"
        "The square root of 2 is about 1.4142 and of 10 about 3.1623." + END,
    ]
    assert _supervised(qwen3, store, 3)[0] == (
        "<think>\nWeather question for Bergen: call get_weather.\n</think>\n\n"
        "Let me check the current weather.\n"
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>' + END
    )
    # Before the last user message Qwen3 drops the reasoning: the call and answer stay trained.
    first, second = _supervised(qwen3, store, 1)[:2]
    assert first.startswith("<tool_call>\n") and "<think>" not in first
    assert second == "250 USD is about 231.50 EUR." + END
    for i in range(len(store)):
        text = "".join(_supervised(qwen3, store, i))
        for hidden in ("<tool_response>", "# Tools", "careful assistant", "<|im_start|>"):
            assert hidden not in text


@pytest.mark.parametrize(
    ("message", "detail"),
    [
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
            "message 0 content part 0 has type 'image_url' (read: text, reasoning, tool_call)",
        ),
        (
            {"role": "user", "content": [{"text": "no type"}]},
            "message 0 content part 0 has type a JSON null (read: text, reasoning, tool_call)",
        ),
        (
            {"role": "user", "content": [{"type": "reasoning", "value": "hm"}]},
            "message 0 content part 0 is a 'reasoning' part in a user turn",
        ),
        (
            {"role": "assistant", "content": [{"type": "tool_call", "value": "{not json"}]},
            "message 0 content part 0 (tool_call) is not a JSON {name, arguments} call",
        ),
        (
            {"role": "assistant", "content": [{"type": "text", "value": 7}]},
            "message 0 content part 0 (text) has no 'text' or 'value' string",
        ),
        (
            {
                "role": "assistant",
                "reasoning_content": "a",
                "content": [{"type": "reasoning", "value": "b"}],
            },
            "message 0 has reasoning both as a field and as 'reasoning' parts",
        ),
    ],
)
def test_unreadable_parts_are_named_in_the_skip_reason(
    message: dict[str, Any], detail: str
) -> None:
    row = {"messages": [message, {"role": "assistant", "content": "ok"}]}
    assert normalise_conversation(row) == Rejected(BAD_SCHEMA, detail)


def test_a_tool_call_part_may_be_an_object_and_parts_join_in_order() -> None:
    row = {
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "value": "b"}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "reasoning", "value": "think "},
                    {"type": "text", "value": "x"},
                    {"type": "reasoning", "value": "more"},
                    {"type": "tool_call", "value": {"name": "f", "arguments": {"k": 1}}},
                ],
            },
        ]
    }
    parsed = normalise_conversation(row)
    assert isinstance(parsed, Conversation)
    assert parsed.messages == [
        {"role": "user", "content": "ab"},
        {
            "role": "assistant",
            "content": "x",
            "reasoning_content": "think more",
            "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"k": 1}}}],
        },
    ]
