"""One row regenerated turn by turn, on the target's own earlier answers.

For each turn (`rows.Turn`) the turn's system/user messages are added and the target answers
the conversation so far, in which every earlier assistant message is its own regenerated one
(as MT-Bench evaluation continues a conversation). A reply that calls tools gets the source's
tool results for that turn, in order, one per call, paired by the call's id, and the target
answers again (its own agent loop) until it answers without a call. Call ids are renamed
`call00001`, `call00002`, ... in the row's order (servers draw random ones: the row would differ
between two runs; 9 alphanumerics is what the strictest templates accept). The conversation ends
early, and says why in the row (`ended`):

* `length`: a reply was cut at `--max-tokens` (the next turn would build on a cut answer);
  counted, and kept (marked `length_capped`) or dropped per `--on-length`;
* `tool_results`: the target called more tools than the source has results for (nothing to
  splice back: regeneration never runs tools).

Every reply passes the think guard of the `--reasoning` mode first (`replies.think_problem`);
one that breaks it fails the row (it goes to the errors file with the reason).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from trainer.data.served import ROW_KEY
from trainer.regen.replies import Reply, think_problem
from trainer.regen.requests import RowFailed
from trainer.regen.rows import SourceRow

Ask = Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], Awaitable[Reply]]
LENGTH = "length"
TOOL_RESULTS = "tool_results"


@dataclass(frozen=True)
class Regenerated:
    """A finished row: the line to write, its generations, whether a reply was cut."""

    row: dict[str, Any]
    generations: int
    length_capped: bool


def _result_text(content: Any) -> str:
    return content if isinstance(content, str) else json.dumps(content, ensure_ascii=False)


def _generation(reply: Reply) -> dict[str, Any]:
    return {
        "prompt_token_ids": list(reply.prompt_ids) if reply.prompt_ids is not None else None,
        "token_ids": list(reply.completion_ids) if reply.completion_ids is not None else None,
        "finish_reason": reply.finish_reason,
    }


async def regenerate(row: SourceRow, ask: Ask, mode: str) -> Regenerated:
    """The row with every assistant turn the target's own (see the module docstring);
    RowFailed when a reply breaks the think guard or a request cannot be answered."""
    sent: list[dict[str, Any]] = []  # the conversation as requests carry it
    kept: list[dict[str, Any]] = []  # ... as OUT stores it (reasoning kept)
    generations: list[dict[str, Any]] = []
    ended: str | None = None
    calls = 0
    for turn in row.turns:
        sent += [dict(m) for m in turn.context]
        kept += [dict(m) for m in turn.context]
        results = list(turn.results)
        while True:
            reply = await ask(list(sent), row.tools)
            problem = think_problem(reply, mode)
            if problem is not None:
                raise RowFailed("think_guard", problem, len(generations) + 1)
            generations.append(_generation(reply))
            ids = [f"call{calls + k + 1:05d}" for k in range(len(reply.tool_calls))]
            calls += len(ids)
            sent.append(_renamed(reply.message(with_reasoning=False), ids))
            kept.append(_renamed(reply.message(with_reasoning=True), ids))
            if reply.finish_reason == LENGTH:
                ended = LENGTH
                break
            if not reply.tool_calls:
                break
            if len(results) < len(reply.tool_calls):
                ended = TOOL_RESULTS
                break
            for call_id in ids:
                result = results.pop(0)
                message = {
                    "role": "tool",
                    "content": _result_text(result["content"]),
                    "tool_call_id": call_id,
                }
                sent.append(message)
                kept.append(dict(message))
        if ended is not None:
            break
    out: dict[str, Any] = {"id": row.id, "messages": kept}
    if row.tools:
        out["tools"] = row.tools
    out[ROW_KEY] = {
        "source": row.source,
        "generations": generations,
        "length_capped": ended == LENGTH,
        "ended": ended,
    }
    return Regenerated(out, len(generations), ended == LENGTH)


def _renamed(message: dict[str, Any], ids: list[str]) -> dict[str, Any]:
    if ids:
        message["tool_calls"] = [
            {**call, "id": call_id}
            for call, call_id in zip(message["tool_calls"], ids, strict=True)
        ]
    return message
