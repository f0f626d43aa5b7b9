"""Parse one chat row into a normalised conversation, or say exactly why it is unusable.

Accepted row shapes (the common public ones):
  {"conversations": [{"role": ..., "content": ...}, ...]}      SpecForge / Nemotron style
  {"messages":      [{"role": ..., "content": ...}, ...]}      OpenAI style (NeMo)
  {"conversation":  [{"role": ..., "content": ...}, ...]}      LMSYS-Chat-1M
  {"conversations": [{"from": "human", "value": ...}, ...]}    ShareGPT / LLaMA-Factory style
Roles: system, user, assistant, tool, plus the ShareGPT names (human; gpt, bing, bard, chatgpt,
model, bot as assistant) and LLaMA-Factory's glaive turns: `function_call` (an assistant tool
call, value = JSON {"name", "arguments"} or a list of them) and `observation` (a tool result).
A row-level `tools` (a list, or the JSON string LLaMA-Factory stores) becomes the template's
`tools`, bare function definitions wrapped as OpenAI {"type": "function", "function": ...}, the
form a server passes to the template at inference. A row-level `system` string (LLaMA-Factory)
becomes the first message. An assistant turn may carry `reasoning_content` (or `reasoning`) and
OpenAI `tool_calls`. Content may be a string or a list of parts ({"type": ..., "text"|"value":
...}, LLaMA-Factory's v1 form): `text` parts are joined into the content; in an assistant turn,
`reasoning` parts are its reasoning (as `reasoning_content`) and each `tool_call` part (JSON
{"name", "arguments"}) one of its tool calls (as `tool_calls`). Any other part type rejects the
row, naming the type.

Pure functions, no tokenizer: bad rows are classified here so the import can count them by
reason without ever raising.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, NotRequired, TypedDict

from trainer.data.served import (
    BAD_SERVED,
    ROW_KEY,
    RegenManifest,
    ServedGeneration,
    is_manifest_row,
    manifest_of,
    parse_served,
)

# Skip reasons, in the order rows are checked; these keys appear in the manifest.
NOT_UTF8 = "not_utf8"
MALFORMED_JSON = "malformed_json"
BAD_SCHEMA = "bad_schema"
EMPTY_CONVERSATION = "empty_conversation"
UNKNOWN_ROLE = "unknown_role"
INVALID_UNICODE = "invalid_unicode"
NO_ASSISTANT_TURN = "no_assistant_turn"

TURN_KEYS = ("conversations", "messages", "conversation")
FUNCTION_CALL = "function_call"
PART_TYPES = ("text", "reasoning", "tool_call")  # content part types read (LLaMA-Factory's v1)
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    # ShareGPT and friends (SpecForge maps bing and bard to the assistant too)
    "human": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
    "bot": "assistant",
    # tool results: LLaMA-Factory/glaive, OpenAI's legacy function role, Llama 3
    "observation": "tool",
    "function": "tool",
    "ipython": "tool",
    FUNCTION_CALL: "assistant",
}


class Message(TypedDict):
    """One canonical chat message, as the chat template receives it."""

    role: str  # system | user | assistant | tool
    content: str
    reasoning_content: NotRequired[str]
    tool_calls: NotRequired[list[dict[str, Any]]]  # OpenAI function calls, as given


_SURROGATE_RE = re.compile("[\ud800-\udfff]")


@dataclass(frozen=True)
class Rejected:
    """Why a row was not turned into a conversation (reason key + short detail for logs)."""

    reason: str
    detail: str


@dataclass(frozen=True)
class Conversation:
    """Normalised messages, the row's tool definitions, and which assistant turns to train.

    `last_turn_only` marks a row made by per-turn expansion: its earlier assistant turns are
    context (trained in their own rows), only the final one is supervised. `served`: the
    server's token ids of a regenerated row, one generation per assistant turn
    (`trainer.data.served`); the store is built from them.
    """

    messages: list[Message]
    tools: list[dict[str, Any]] | None = None
    last_turn_only: bool = False
    served: tuple[ServedGeneration, ...] | None = None


@dataclass(frozen=True)
class MetaRow:
    """A line that is not a row: a regenerated file's manifest (`problem`: why it is unreadable)."""

    manifest: RegenManifest | None
    problem: str | None = None


def parse_line(raw: bytes) -> Conversation | Rejected | MetaRow | None:
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
        return Rejected(MALFORMED_JSON, json_error(exc))
    except (ValueError, RecursionError) as exc:  # 5000-digit ints, absurdly deep nesting
        return Rejected(MALFORMED_JSON, " ".join(str(exc).split())[:120])
    return normalise_conversation(row)


def json_error(exc: json.JSONDecodeError) -> str:
    """`Expecting ',' delimiter at column 17`; `Unterminated string starting at column 9`."""
    return f"{exc.msg.removesuffix(' at')} at column {exc.colno}"


def normalise_row(row: Any) -> list[Message] | Rejected:
    """The messages of a decoded row (see `normalise_conversation` for tools and the rest)."""
    conversation = normalise_conversation(row)
    if isinstance(conversation, MetaRow):
        return Rejected(BAD_SCHEMA, "a regenerated file's manifest line, not a row")
    return conversation if isinstance(conversation, Rejected) else conversation.messages


def normalise_conversation(row: Any) -> Conversation | Rejected | MetaRow:
    """Turn a decoded row into canonical messages + tools, or the reason it is unusable (a
    regenerated file's manifest line is a `MetaRow`)."""
    if is_manifest_row(row):
        found = manifest_of(row)
        return MetaRow(None, found) if isinstance(found, str) else MetaRow(found)
    if not isinstance(row, dict):
        return Rejected(BAD_SCHEMA, f"row is a JSON {_json_type(row)}, not an object")
    key = next((k for k in TURN_KEYS if k in row), None)
    if key is None:
        keys = ", ".join(repr(k) for k in list(row)[:8])
        return Rejected(
            BAD_SCHEMA, f"no 'conversations', 'messages' or 'conversation' key, keys were [{keys}]"
        )
    turns = row[key]
    if not isinstance(turns, list):
        return Rejected(BAD_SCHEMA, f"'{key}' is a JSON {_json_type(turns)}, not a list")
    if not turns:
        return Rejected(EMPTY_CONVERSATION, f"'{key}' is empty")
    tools = _tools(row.get("tools"))
    if isinstance(tools, Rejected):
        return tools
    messages: list[Message] = []
    system = row.get("system")
    if isinstance(system, str) and system and not _has_system(turns):
        messages.append({"role": "system", "content": system})
    for k, turn in enumerate(turns):
        parsed = _normalise_turn(k, turn)
        if isinstance(parsed, Rejected):
            return parsed
        messages.append(parsed)
    bad = _lone_surrogate(messages, tools)
    if bad is not None:
        return Rejected(INVALID_UNICODE, bad)
    turns = sum(m["role"] == "assistant" for m in messages)
    if not turns:
        return Rejected(NO_ASSISTANT_TURN, "no assistant message to supervise")
    served = parse_served(row.get(ROW_KEY), turns)
    if isinstance(served, str):
        return Rejected(BAD_SERVED, served)
    return Conversation(messages, tools, served=served)


def has_reasoning(message: Message) -> bool:
    """An assistant turn with a think block: `reasoning_content`, or inline `...</think>`."""
    return message["role"] == "assistant" and (
        bool(message.get("reasoning_content")) or "</think>" in message["content"]
    )


def expand_turns(conversation: Conversation) -> list[Conversation]:
    """One conversation per assistant turn, ending at it (SpecForge's per-turn expansion).

    Templates such as Qwen3's render reasoning only on the final assistant turn, so without
    this every earlier turn's reasoning is dropped; with it, row k trains turn k only.
    """
    ends = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
    if len(ends) <= 1:
        return [conversation]
    return [
        Conversation(conversation.messages[: i + 1], conversation.tools, last_turn_only=True)
        for i in ends
    ]


def served_turns(conversation: Conversation) -> list[Conversation]:
    """A regenerated row as one conversation per generation (as `expand_turns`), each carrying
    the server's ids for its final turn: the store trains each generation on the prompt the
    server saw (speculators' one sample per generation)."""
    assert conversation.served is not None
    ends = [i for i, m in enumerate(conversation.messages) if m["role"] == "assistant"]
    return [
        Conversation(
            conversation.messages[: i + 1], conversation.tools, last_turn_only=True, served=(gen,)
        )
        for i, gen in zip(ends, conversation.served, strict=True)
    ]


def _has_system(turns: list[Any]) -> bool:
    first = turns[0] if turns else None
    return isinstance(first, dict) and first.get("role", first.get("from")) == "system"


def _normalise_turn(k: int, turn: Any) -> Message | Rejected:
    if not isinstance(turn, dict):
        return Rejected(BAD_SCHEMA, f"message {k} is a JSON {_json_type(turn)}, not an object")
    role = turn.get("role", turn.get("from"))
    if not isinstance(role, str):
        return Rejected(BAD_SCHEMA, f"message {k} has no 'role'/'from' string")
    name = role.strip().lower()
    canonical = ROLE_ALIASES.get(name)
    if canonical is None:
        return Rejected(UNKNOWN_ROLE, f"role {role[:40]!r}")
    raw_content = turn.get("content", turn.get("value"))
    if name == FUNCTION_CALL:
        calls = _function_call(raw_content)
        if calls is None:
            return Rejected(
                BAD_SCHEMA, f"message {k} (function_call) is not a JSON {{name, arguments}} call"
            )
        return {"role": "assistant", "content": "", "tool_calls": calls}
    tool_calls = turn.get("tool_calls") if canonical == "assistant" else None
    if tool_calls is not None and not _valid_tool_calls(tool_calls):
        return Rejected(BAD_SCHEMA, f"message {k} tool_calls is not a list of function calls")
    if raw_content is None and tool_calls:
        raw_content = ""  # OpenAI: an assistant turn that only calls tools has content null
    parts = _content_parts(k, canonical, raw_content)
    if isinstance(parts, Rejected):
        return parts
    message: Message = {"role": canonical, "content": parts.text}
    reasoning = turn.get("reasoning_content", turn.get("reasoning"))
    reasoning = reasoning if canonical == "assistant" and isinstance(reasoning, str) else ""
    if reasoning and parts.reasoning:
        return Rejected(
            BAD_SCHEMA, f"message {k} has reasoning both as a field and as 'reasoning' parts"
        )
    if reasoning or parts.reasoning:
        message["reasoning_content"] = reasoning or parts.reasoning
    if tool_calls and parts.tool_calls:
        return Rejected(
            BAD_SCHEMA, f"message {k} has tool calls both in 'tool_calls' and as 'tool_call' parts"
        )
    called: list[dict[str, Any]] | None = tool_calls or parts.tool_calls
    if called:
        message["tool_calls"] = called
    return message


@dataclass(frozen=True)
class _Parts:
    """One message's content split by part type (a plain string is all text)."""

    text: str
    reasoning: str = ""
    tool_calls: list[dict[str, Any]] | None = None


def _content_parts(k: int, role: str, content: Any) -> _Parts | Rejected:
    """A content string, or its parts: text joined, and (assistant turns) reasoning and tool
    calls, read as LLaMA-Factory's own renderer reads them."""
    if isinstance(content, str):
        return _Parts(content)
    if not isinstance(content, list):
        return Rejected(
            BAD_SCHEMA, f"message {k} content is a JSON {_json_type(content)}, not text"
        )
    texts: list[str] = []
    thoughts: list[str] = []
    calls: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        where = f"message {k} content part {j}"
        if not isinstance(part, dict):
            return Rejected(BAD_SCHEMA, f"{where} is a JSON {_json_type(part)}, not an object")
        kind = part.get("type")
        value = part.get("text", part.get("value"))
        if kind not in PART_TYPES:
            named = repr(kind)[:40] if isinstance(kind, str) else f"a JSON {_json_type(kind)}"
            return Rejected(BAD_SCHEMA, f"{where} has type {named} (read: {', '.join(PART_TYPES)})")
        if kind != "text" and role != "assistant":
            return Rejected(BAD_SCHEMA, f"{where} is a {kind!r} part in a {role} turn")
        if kind == "tool_call":
            call = _function_call(value)
            if call is None:
                return Rejected(
                    BAD_SCHEMA, f"{where} (tool_call) is not a JSON {{name, arguments}} call"
                )
            calls.extend(call)
        elif not isinstance(value, str):
            return Rejected(BAD_SCHEMA, f"{where} ({kind}) has no 'text' or 'value' string")
        else:
            (texts if kind == "text" else thoughts).append(value)
    return _Parts("".join(texts), "".join(thoughts), calls or None)


def _function_call(value: Any) -> list[dict[str, Any]] | None:
    """glaive/LLaMA-Factory `function_call` value -> OpenAI tool_calls, or None if unusable."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return None
    calls = value if isinstance(value, list) else [value]
    out = []
    for call in calls:
        if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
            return None
        arguments = call.get("arguments", {})
        out.append({"type": "function", "function": {"name": call["name"], "arguments": arguments}})
    return out or None


def _tools(value: Any) -> list[dict[str, Any]] | Rejected | None:
    """Row-level tool definitions in OpenAI form, None when the row has none."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return Rejected(BAD_SCHEMA, "'tools' is a string but not JSON")
        if value == [] or value is None:
            return None
    if isinstance(value, dict):
        value = [value]
    if not isinstance(value, list):
        return Rejected(BAD_SCHEMA, f"'tools' is a JSON {_json_type(value)}, not a list")
    tools = []
    for k, tool in enumerate(value):
        if isinstance(tool, dict) and isinstance(tool.get("function"), dict):
            tools.append(tool)
        elif isinstance(tool, dict) and isinstance(tool.get("name"), str):
            tools.append({"type": "function", "function": tool})
        else:
            return Rejected(BAD_SCHEMA, f"tools[{k}] is not a function definition")
    return tools


def _valid_tool_calls(calls: Any) -> bool:
    """OpenAI shape: [{"type": "function", "function": {"name": str, "arguments": ...}}]."""
    if not isinstance(calls, list):
        return False
    for call in calls:
        function = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)):
            return False
    return True


def content_text(content: Any) -> str | None:
    """A message content as text: a string, or OpenAI/ShareGPT text parts joined; else None."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # parts: [{"type": "text", "text"|"value": ...}, ...]
        texts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                return None
            text = part.get("text", part.get("value"))
            if not isinstance(text, str):
                return None
            texts.append(text)
        return "".join(texts)
    return None


def _lone_surrogate(messages: list[Message], tools: list[dict[str, Any]] | None) -> str | None:
    """Where a lone UTF-16 surrogate (scraped '\\ud83d') sits: no tokenizer can encode it."""
    for k, message in enumerate(messages):
        for key in ("content", "reasoning_content"):
            text = message.get(key)
            if isinstance(text, str) and (hit := _SURROGATE_RE.search(text)):
                return _surrogate_detail(f"message {k} {key}", text, hit.start())
        if "tool_calls" in message:
            dumped = json.dumps(message["tool_calls"], ensure_ascii=False)
            if hit := _SURROGATE_RE.search(dumped):
                return _surrogate_detail(f"message {k} tool_calls", dumped, hit.start())
    if tools is not None:
        dumped = json.dumps(tools, ensure_ascii=False)
        if hit := _SURROGATE_RE.search(dumped):
            return _surrogate_detail("tools", dumped, hit.start())
    return None


def _surrogate_detail(where: str, text: str, at: int) -> str:
    return f"{where} has a lone surrogate {text[at]!r} at character {at}"


def _json_type(value: Any) -> str:
    names = {dict: "object", list: "array", str: "string", bool: "boolean", type(None): "null"}
    return names.get(type(value), "number")
