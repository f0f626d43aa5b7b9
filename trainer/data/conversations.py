"""Parse one chat-JSONL line into normalised messages, or say exactly why it is unusable.

Accepted row shapes (the common public ones):
  {"conversations": [{"role": ..., "content": ...}, ...]}      SpecForge / Nemotron style
  {"messages":      [{"role": ..., "content": ...}, ...]}      OpenAI style (NeMo)
  {"conversations": [{"from": "human", "value": ...}, ...]}    ShareGPT style
OpenAI content may also be a list of parts; only text parts are accepted. An assistant turn may
carry `reasoning_content` and OpenAI `tool_calls` (content may then be null); both are passed
through to templates that render them (Qwen's do), and tool results use role "tool".

Pure functions, no tokenizer: bad rows are classified here so the import can count them by
reason without ever raising.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

# Skip reasons, in the order rows are checked; these keys appear in the manifest.
NOT_UTF8 = "not_utf8"
MALFORMED_JSON = "malformed_json"
BAD_SCHEMA = "bad_schema"
EMPTY_CONVERSATION = "empty_conversation"
UNKNOWN_ROLE = "unknown_role"
NO_ASSISTANT_TURN = "no_assistant_turn"

ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    # ShareGPT and friends
    "human": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "bot": "assistant",
}

Message = dict[str, Any]  # role, content[, reasoning_content][, tool_calls]


@dataclass(frozen=True)
class Rejected:
    """Why a line was not turned into a conversation (reason key + short detail for logs)."""

    reason: str
    detail: str


def parse_line(raw: bytes) -> list[Message] | Rejected | None:
    """Decode and validate one JSONL line; None for a blank line (ignored, not an error)."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return Rejected(NOT_UTF8, f"invalid UTF-8 at byte {exc.start}")
    text = text.removeprefix("\ufeff")
    if not text.strip():
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        return Rejected(MALFORMED_JSON, f"{exc.msg} at column {exc.colno}")
    except (ValueError, RecursionError) as exc:  # 5000-digit ints, absurdly deep nesting
        return Rejected(MALFORMED_JSON, " ".join(str(exc).split())[:120])
    return normalise_row(row)


def normalise_row(row: Any) -> list[Message] | Rejected:
    """Turn a decoded row into [{"role", "content"[, "reasoning_content"]}] with canonical roles."""
    if not isinstance(row, dict):
        return Rejected(BAD_SCHEMA, f"row is a JSON {type(row).__name__}, not an object")
    turns = row.get("conversations", row.get("messages"))
    if turns is None:
        return Rejected(BAD_SCHEMA, "no 'conversations' or 'messages' key")
    if not isinstance(turns, list):
        return Rejected(BAD_SCHEMA, "'conversations'/'messages' is not a list")
    if not turns:
        return Rejected(EMPTY_CONVERSATION, "no messages")
    messages: list[Message] = []
    for k, turn in enumerate(turns):
        parsed = _normalise_turn(k, turn)
        if isinstance(parsed, Rejected):
            return parsed
        messages.append(parsed)
    if not any(m["role"] == "assistant" for m in messages):
        return Rejected(NO_ASSISTANT_TURN, "no assistant message to supervise")
    return messages


def _normalise_turn(k: int, turn: Any) -> Message | Rejected:
    if not isinstance(turn, dict):
        return Rejected(BAD_SCHEMA, f"message {k} is not an object")
    role = turn.get("role", turn.get("from"))
    if not isinstance(role, str):
        return Rejected(BAD_SCHEMA, f"message {k} has no 'role'/'from' string")
    canonical = ROLE_ALIASES.get(role.strip().lower())
    if canonical is None:
        return Rejected(UNKNOWN_ROLE, f"message {k} role {role[:40]!r}")
    raw_content = turn.get("content", turn.get("value"))
    tool_calls = turn.get("tool_calls") if canonical == "assistant" else None
    if tool_calls is not None and not _valid_tool_calls(tool_calls):
        return Rejected(BAD_SCHEMA, f"message {k} tool_calls is not a list of function calls")
    if raw_content is None and tool_calls:
        raw_content = ""  # OpenAI: an assistant turn that only calls tools has content null
    content = _content_text(raw_content)
    if content is None:
        return Rejected(BAD_SCHEMA, f"message {k} content is not text")
    message: Message = {"role": canonical, "content": content}
    reasoning = turn.get("reasoning_content")
    if canonical == "assistant" and isinstance(reasoning, str) and reasoning:
        message["reasoning_content"] = reasoning
    if tool_calls:
        message["tool_calls"] = tool_calls
    return message


def _valid_tool_calls(calls: Any) -> bool:
    """OpenAI shape: [{"type": "function", "function": {"name": str, "arguments": ...}}]."""
    if not isinstance(calls, list):
        return False
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            return False
    return True


def _content_text(content: Any) -> str | None:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI parts: [{"type": "text", "text": ...}, ...]
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                return None
            text = part.get("text")
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "".join(texts)
    return None
