"""A chat completion as regeneration reads it, and the think guard. Pure.

`parse_reply` takes the first choice of an OpenAI chat completion: its content, its reasoning
(vLLM's `reasoning`, SGLang's and older vLLM's `reasoning_content`), its tool calls and finish
reason, the token counts, and the token ids where the server returns them (vLLM with
`return_token_ids`: the response's `prompt_token_ids` and the choice's `token_ids`).

The think guard (`think_problem`) is the `--reasoning` rule, applied to every reply:

* `disable`: the request asks `enable_thinking: false`; a reply that still thinks (a think
  marker in its content, or reasoning the server's parser split off) is rejected: a drafter
  trained on it would learn text the target does not say when served with thinking off.
* `save`: the request asks `enable_thinking: true` and keeps the reasoning; a think marker left
  in the content or the reasoning means the server runs no reasoning parser (or the model broke
  its format), and the row would train the markers as text: rejected.
* `none`: nothing is asked and nothing rejected (the server's default mode, recorded as such).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

THINK_MARKERS = ("<think>", "</think>")
MODE_KWARGS: dict[str, dict[str, Any]] = {
    "none": {},
    "save": {"enable_thinking": True},
    "disable": {"enable_thinking": False},
}
"""The chat_template_kwargs each --reasoning mode sends (SpecForge's rule)."""


class ReplyError(ValueError):
    """A 200 answer that is not a usable chat completion (one line: what is missing)."""


@dataclass(frozen=True)
class Reply:
    """The first choice of a chat completion, with the request's token counts and ids."""

    content: str
    reasoning: str | None
    tool_calls: tuple[dict[str, Any], ...]
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    prompt_ids: tuple[int, ...] | None
    completion_ids: tuple[int, ...] | None

    def message(self, *, with_reasoning: bool) -> dict[str, Any]:
        """The assistant message: as stored in OUT (`with_reasoning`), or as sent back in the
        next request's history (no reasoning: what an OpenAI client sends)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if with_reasoning and self.reasoning:
            out["reasoning_content"] = self.reasoning
        if self.tool_calls:
            out["tool_calls"] = [dict(call) for call in self.tool_calls]
        return out


def _ids(value: Any) -> tuple[int, ...] | None:
    if isinstance(value, list) and all(type(i) is int and i >= 0 for i in value):
        return tuple(value)
    return None


def _count(usage: Any, key: str, fallback: int) -> int:
    value = usage.get(key) if isinstance(usage, dict) else None
    return value if type(value) is int and value >= 0 else fallback


def _tool_call(call: Any, k: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ReplyError(f"tool_calls[{k}] has no function name")
    args = fn.get("arguments", "{}")
    out: dict[str, Any] = {
        "type": "function",
        "function": {"name": fn["name"], "arguments": args},
    }
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def parse_reply(data: Any) -> Reply:
    """The reply in a decoded chat completion; ReplyError naming what is missing."""
    if not isinstance(data, dict):
        raise ReplyError("the answer is not a JSON object")
    choices = data.get("choices")
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise ReplyError("no choices[0] in the answer")
    choice = choices[0]
    message = choice.get("message")
    if not isinstance(message, dict):
        raise ReplyError("choices[0] has no message")
    content = message.get("content")
    if content is not None and not isinstance(content, str):
        raise ReplyError("choices[0].message.content is not text")
    reasoning = message.get("reasoning_content", message.get("reasoning"))
    if reasoning is not None and not isinstance(reasoning, str):
        raise ReplyError("choices[0].message.reasoning is not text")
    raw_calls = message.get("tool_calls") or []
    if not isinstance(raw_calls, list):
        raise ReplyError("choices[0].message.tool_calls is not a list")
    calls = tuple(_tool_call(c, k) for k, c in enumerate(raw_calls))
    completion_ids = _ids(choice.get("token_ids"))
    prompt_ids = _ids(data.get("prompt_token_ids"))
    usage = data.get("usage")
    return Reply(
        content=content or "",
        reasoning=reasoning or None,
        tool_calls=calls,
        finish_reason=str(choice.get("finish_reason") or ""),
        prompt_tokens=_count(usage, "prompt_tokens", len(prompt_ids or ())),
        completion_tokens=_count(usage, "completion_tokens", len(completion_ids or ())),
        prompt_ids=prompt_ids,
        completion_ids=completion_ids,
    )


def think_problem(reply: Reply, mode: str) -> str | None:
    """Why `reply` breaks the `--reasoning` mode's rule (module docstring); None when it holds."""
    if mode == "none":
        return None
    marker = next((m for m in THINK_MARKERS if m in reply.content), None)
    if mode == "disable":
        if marker is not None:
            return f"the reply holds {marker!r} with --reasoning disable (thinking was not off)"
        if reply.reasoning and reply.reasoning.strip():
            return (
                "the server returned reasoning with --reasoning disable (the chat template "
                "ignored enable_thinking: false?)"
            )
        return None
    in_reasoning = next((m for m in THINK_MARKERS if m in (reply.reasoning or "")), None)
    if marker is not None or in_reasoning is not None:
        where = "content" if marker is not None else "reasoning"
        return (
            f"a {marker or in_reasoning!r} marker is left in the {where} with --reasoning save: "
            "start the server with a reasoning parser (vLLM: --reasoning-parser qwen3)"
        )
    return None
