"""The source rows of a regeneration: read with the importer's readers, each with its id and the
turns the target will answer. Pure, apart from reading the input files.

A row is read exactly as `python -m trainer.data import` reads it (`ChatSource`: JSONL or one
JSON array, plain or .gz, every format the importer knows), and a row it cannot use is skipped
with its line and reason in the importer's own accounting (`ImportStats`): never fatal.

Its id is a content hash of the normalised row (messages and tools), so it is the same however
the file was cut, ordered or concatenated, and an identical row met twice is one row.

The turns: every run of system/user messages followed by an assistant reply in the source is
one turn; the source's tool results after that reply (before the next user message) are the
turn's results, spliced back in order after the target's own tool calls. The source's
assistant text is never sent: the target answers on its own earlier answers. User messages
after the last assistant reply have nothing to regenerate and are left out.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.data.chat_import import ImportStats
from trainer.data.conversations import Conversation, Message, MetaRow, Rejected
from trainer.data.sources import ChatSource

NO_USER_TURN = "no_user_before_assistant"
MANIFEST_IN_INPUT = "regen_manifest_line"  # an input that is itself a regenerated file
DUPLICATE = "duplicate_row"


@dataclass(frozen=True)
class Turn:
    """Messages to add before the target answers, and the source's tool results for its calls."""

    context: tuple[Message, ...]
    results: tuple[Message, ...]


@dataclass(frozen=True)
class SourceRow:
    """One usable input row: its id, where it came from and what to regenerate."""

    id: str
    source: str  # FILE:LINE
    tools: list[dict[str, Any]] | None
    turns: tuple[Turn, ...]


def row_id(conversation: Conversation) -> str:
    """32 hex digits of the sha256 of the normalised row (messages, tools), key order fixed."""
    canonical = json.dumps(
        {"messages": conversation.messages, "tools": conversation.tools},
        sort_keys=True,
        ensure_ascii=False,
        separators=(",", ":"),
    )
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def plan_turns(messages: list[Message]) -> tuple[Turn, ...] | str:
    """The turns of a row (see the module docstring), or why it has none to regenerate."""
    turns: list[Turn] = []
    context: list[Message] = []
    asked = False  # a user message came before
    i, n = 0, len(messages)
    while i < n:
        m = messages[i]
        if m["role"] in ("system", "user"):
            context.append({"role": m["role"], "content": m["content"]})
            asked = asked or m["role"] == "user"
            i += 1
            continue
        if m["role"] == "tool":  # a result with no call before it in this turn: not sendable
            i += 1
            continue
        if not asked:
            return f"message {i} is an assistant reply with no user message before it"
        results: list[Message] = []
        j = i + 1
        while j < n and messages[j]["role"] in ("assistant", "tool"):
            if messages[j]["role"] == "tool":
                results.append({"role": "tool", "content": messages[j]["content"]})
            j += 1
        turns.append(Turn(tuple(context), tuple(results)))
        context = []
        i = j
    return tuple(turns)


def read_rows(
    paths: list[Path], stats: ImportStats, seen: set[str] | None = None
) -> Iterator[SourceRow]:
    """Every usable row of the inputs in order; the rest counted in `stats` (the importer's
    accounting: reason, line, detail). `seen` collects ids: a row met again is a duplicate."""
    ids = set() if seen is None else seen
    for path in paths:
        source = ChatSource(path)
        for line, parsed in source:
            stats.lines += 1
            if parsed is None:
                stats.blank_lines += 1
                continue
            stats.rows += 1
            where = f"{path}:{line}"
            if isinstance(parsed, MetaRow):
                stats.skip(MANIFEST_IN_INPUT, line, f"{where}: a regenerated file's manifest")
                continue
            if isinstance(parsed, Rejected):
                stats.skip(parsed.reason, line, f"{path.name}: {parsed.detail}")
                continue
            turns = plan_turns(parsed.messages)
            if isinstance(turns, str):
                stats.skip(NO_USER_TURN, line, f"{path.name}: {turns}")
                continue
            rid = row_id(parsed)
            if rid in ids:
                stats.skip(DUPLICATE, line, f"{path.name}: the same row as an earlier line")
                continue
            ids.add(rid)
            yield SourceRow(rid, where, parsed.tools, turns)
