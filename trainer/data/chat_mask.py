"""Tokenise conversations with the target's chat template and mark the assistant tokens.

Both strategies produce the rendered text plus the character spans to supervise; one shared
tail then applies the think-block rule, tokenises (one batched call, row-by-row when a row
breaks it) and maps spans to tokens. The chosen strategy is recorded in the store manifest:

* ``generation-tags``: the template wraps assistant output in ``{% generation %}`` blocks
  (ModelOpt's patched Qwen3 template, many newer templates); transformers' renderer reports the
  exact character spans rendered inside them.
* ``sentinel-diff`` (any other template): render the whole conversation once, then once more
  per assistant turn with that turn's content (and reasoning, if any) replaced by a sentinel.
  The characters where the two renders differ are exactly the text the template derived from
  that turn, wherever it put it and however it rewrote the rest (Qwen3 renders history without
  the think block it gives the final turn); the control token right after it (the end of turn,
  e.g. ``<|im_end|>``) is supervised too, because the drafter must learn to stop. Headers, the
  newline between turns and template boilerplate are not. A turn the template does not
  render, or whose text shows up anywhere but in one place, is left unsupervised and counted
  (``unlocated_turns``) rather than guessed at.

Think blocks (both strategies): a rendered, non-empty think block is supervised from its
opening tag (``<think>\\n``): in thinking mode the target emits that tag itself, so the drafter
must draft it. An empty block (``<think>\\n\\n</think>\\n\\n``, what Qwen3 renders for a turn
without reasoning and what its non-thinking prompt contains) is never supervised. Reasoning the
template drops (Qwen3 drops it from history turns) is counted per row (``reasoning_dropped``).

The overlap rule matches transformers' own so both strategies agree on the same template.
Content that contains the tokenizer's special tokens (e.g. a literal ``<|im_end|>``) would be
encoded as control tokens and silently change the turn structure, so such rows are rejected.
Any failure of one row (template error, text the tokenizer cannot encode) rejects that row only.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import numpy as np

from trainer.data.chat_spans import (
    CONTENT_SENTINEL,
    THINK_CLOSE,
    THINK_OPEN,
    Span,
    all_turn_sentinels,
    common_prefix,
    spans_one_pass,
    turn_span,
    with_sentinels,
)
from trainer.data.conversations import Conversation, Message, Rejected, has_reasoning

GENERATION_TAGS = "generation-tags"
SENTINEL_DIFF = "sentinel-diff"
TEMPLATE_ERROR = "template_error"
TOKENIZER_ERROR = "tokenizer_error"
ENCODE_ERROR = "encode_error"
CONTROL_TOKEN_IN_CONTENT = "control_token_in_content"

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
_THINK_OPEN_BEFORE = re.compile(r"<think>[ \t\r\n]*\Z")  # searched with endpos = span start
# After `</think>` only newlines: Qwen3 writes "\n\n" and strips the content's leading ones.
_EMPTY_THINK = re.compile(r"<think>[ \t\r\n]*</think>\n*")
_THINK_LOOKBACK = 32

T = TypeVar("T")
In = TypeVar("In")


@dataclass(frozen=True)
class Encoded:
    """One tokenised conversation: ids, aligned loss mask, and what was left unsupervised."""

    tokens: np.ndarray  # int32
    mask: np.ndarray  # uint8, 1 on assistant tokens
    unlocated_turns: int = 0
    reasoning_turns: int = 0  # trained assistant turns that carry reasoning
    reasoning_dropped: int = 0  # ... whose reasoning the template did not render
    think_in_content: str | None = None  # a trained turn's content the template split at
    # `</think>` (`think_in_content`): where, for the import summary; None when no turn was


@dataclass(frozen=True)
class _Plan:
    text: str
    spans: list[Span]
    unlocated: int = 0


def mask_from_spans(offsets: Any, spans: list[tuple[int, int]]) -> np.ndarray:
    """1 for every token whose character range [start, end) overlaps one of the sorted spans.

    Same rule as transformers' assistant mask: find the first span ending after the token
    starts, and mark the token if it ends after that span starts.
    """
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    mask = np.zeros(len(off), dtype=np.uint8)
    if not spans or not len(off):
        return mask
    sp = np.asarray(spans, dtype=np.int64)
    k = np.searchsorted(sp[:, 1], off[:, 0], side="right")
    inside = k < len(sp)
    k = np.minimum(k, len(sp) - 1)
    mask[inside & (off[:, 1] > sp[k, 0])] = 1
    return mask


def as_conversation(row: Conversation | list[Message]) -> Conversation:
    return row if isinstance(row, Conversation) else Conversation(list(row))


def control_token(control: re.Pattern[str] | None, row: Conversation) -> str | None:
    """The first of the tokenizer's special tokens (`control`, one pattern) that a row's
    content, reasoning, tool calls or tools spell, else None."""
    if control is None:
        return None
    texts = [json.dumps(row.tools, ensure_ascii=False)] if row.tools else []
    for message in row.messages:
        texts += [message["content"], message.get("reasoning_content", "")]
        if "tool_calls" in message:
            texts.append(json.dumps(message["tool_calls"], ensure_ascii=False))
    for text in texts:
        found = control.search(text)
        if found:
            return found.group(0)
    return None


def encoded(row: Conversation, plan: _Plan, encoding: tuple[Any, Any]) -> Encoded:
    """The row's tokens and loss mask from its plan (text, spans) and tokenisation (ids,
    character offsets), with what it left unsupervised."""
    ids, offsets = encoding
    return Encoded(
        np.asarray(ids, dtype=np.int32),
        mask_from_spans(offsets, apply_think_rule(plan.text, plan.spans)),
        unlocated_turns=plan.unlocated,
        reasoning_turns=sum(map(has_reasoning, _trained(row))),
        reasoning_dropped=reasoning_dropped(row, plan.text),
        think_in_content=think_in_content(row, plan.text),
    )


class ChatEncoder:
    """Turns normalised conversations into (tokens, mask) with one tokenizer and chat template."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        if not getattr(tokenizer, "is_fast", False):
            raise ValueError("a fast tokenizer (tokenizer.json) is needed for character offsets")
        template = tokenizer.get_chat_template()  # raises ValueError when there is none
        self.tokenizer = tokenizer
        self.template_kwargs = dict(template_kwargs or {})
        self.strategy = GENERATION_TAGS if _GENERATION_RE.search(template) else SENTINEL_DIFF
        specials = sorted(
            (t.content for t in tokenizer.added_tokens_decoder.values() if t.special and t.content),
            key=len,
            reverse=True,
        )
        self._control_re = re.compile("|".join(map(re.escape, specials))) if specials else None

    def encode_batch(
        self, conversations: Sequence[Conversation | list[Message]]
    ) -> list[Encoded | Rejected]:
        """Encode many conversations; a bad one becomes a Rejected, never an exception."""
        rows = [as_conversation(c) for c in conversations]
        results: list[Encoded | Rejected | None] = [None] * len(rows)
        groups: dict[str, list[int]] = {}  # rows sharing a tools list render in one call
        for i, row in enumerate(rows):
            try:
                hit = control_token(self._control_re, row)
            except Exception as exc:  # content that is not text, from a caller but the parser
                results[i] = Rejected(ENCODE_ERROR, _one_line(exc))
                continue
            if hit is not None:
                results[i] = Rejected(CONTROL_TOKEN_IN_CONTENT, f"content contains {hit!r}")
            else:
                groups.setdefault(_tools_key(row.tools), []).append(i)
        plans: dict[int, _Plan | Rejected] = {}
        for members in groups.values():
            batch = [rows[i] for i in members]
            planner = self._plan_tags if self.strategy == GENERATION_TAGS else self._plan_diff
            for i, p in zip(members, _isolated(planner, batch, TEMPLATE_ERROR), strict=True):
                plans[i] = p
        ready = [i for i in sorted(plans) if not isinstance(plans[i], Rejected)]
        texts = [_text(plans[i]) for i in ready]
        encodings = dict(zip(ready, _isolated(self._tokenize, texts, TOKENIZER_ERROR), strict=True))
        for i, plan in plans.items():
            if isinstance(plan, Rejected):
                results[i] = plan
                continue
            encoding = encodings[i]
            if isinstance(encoding, Rejected):
                results[i] = encoding
                continue
            try:
                results[i] = encoded(rows[i], plan, encoding)
            except Exception as exc:  # never let one row's oddity escape the batch
                results[i] = Rejected(ENCODE_ERROR, _one_line(exc))
        assert all(r is not None for r in results)
        return [r for r in results if r is not None]

    def render(self, conversation: Conversation | list[Message]) -> str:
        """The template's own rendering of one conversation (what the store's tokens spell)."""
        row = as_conversation(conversation)
        return self._render_many([row.messages], row.tools)[0]

    def _tokenize(self, texts: list[str]) -> list[tuple[Any, Any]]:
        if not texts:
            return []
        out = self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
        return list(zip(out["input_ids"], out["offset_mapping"], strict=True))

    # -- generation tags --------------------------------------------------------------------

    def _plan_tags(self, batch: list[Conversation]) -> list[_Plan]:
        from transformers.utils.chat_template_utils import render_jinja_template

        tools = batch[0].tools
        hf_tools: list[dict[Any, Any] | Callable[..., Any]] | None = (
            None if tools is None else list(tools)
        )
        # transformers annotates `-> str`; with return_assistant_tokens_mask it returns
        # (texts, per-text generation spans).
        texts, indices = cast(
            tuple[list[str], list[list[tuple[int, int]]]],
            render_jinja_template(
                # transformers' ChatType is list[dict[str, Any]]; a Message is such a dict.
                conversations=cast(list[list[dict[str, Any]]], [row.messages for row in batch]),
                tools=hf_tools,
                chat_template=self.tokenizer.get_chat_template(None, tools),
                return_assistant_tokens_mask=True,
                add_generation_prompt=False,
                **{**self.tokenizer.special_tokens_map, **self.template_kwargs},
            ),
        )
        plans = []
        for row, text, spans in zip(batch, texts, indices, strict=True):
            found = sorted((int(a), int(b)) for a, b in spans if b > a)
            unlocated = 0
            if row.last_turn_only:
                start = self._last_turn_start(row, text)
                unlocated = int(start is None)
                found = [] if start is None else [s for s in found if s[1] > start]
            plans.append(_Plan(str(text), found, unlocated))
        return plans

    def _last_turn_start(self, row: Conversation, full: str) -> int | None:
        """Where the final assistant turn's own text begins (diff against its sentinel copy)."""
        last = len(row.messages) - 1
        variant = self._render_many([with_sentinels(row.messages, last)], row.tools)[0]
        if variant.count(CONTENT_SENTINEL) != 1:
            return None
        return common_prefix(full, variant)

    # -- sentinel diff -------------------------------------------------------------------

    def _plan_diff(self, batch: list[Conversation]) -> list[_Plan]:
        """Full text, assistant character spans and unlocated-turn count per conversation.

        Fast path: one extra render with every assistant turn swapped for its own numbered
        sentinel; if the constant text between sentinels (which holds the turn's control
        tokens) re-appears in order in the real render, the gaps are the turns. Templates whose
        text around a turn depends on its content, or that drop or repeat turns, fall back to
        one render per turn (the diff against a single swapped turn). A per-turn-expanded row
        is diffed on its final turn only.
        """
        tools = batch[0].tools
        fulls = self._render_many([row.messages for row in batch], tools)
        spans: list[list[Span]] = [[] for _ in batch]
        unlocated = [0] * len(batch)
        quick = [
            (r, v)
            for r, row in enumerate(batch)
            if not row.last_turn_only and (v := all_turn_sentinels(row.messages)) is not None
        ]
        rendered = self._render_many([v for _, v in quick], tools)
        slow = set(range(len(batch)))
        for (r, _), text in zip(quick, rendered, strict=True):
            turns = sum(m["role"] == "assistant" for m in batch[r].messages)
            found = spans_one_pass(self._control_re, fulls[r], text, turns)
            if found is not None:
                slow.discard(r)
                spans[r] = [span for span in found if span is not None]
                unlocated[r] = found.count(None)
        owners: list[int] = []
        variants: list[list[Message]] = []
        for r in sorted(slow):
            messages = batch[r].messages
            first = len(messages) - 1 if batch[r].last_turn_only else 0
            for i in range(first, len(messages)):
                if messages[i]["role"] == "assistant":
                    owners.append(r)
                    variants.append(with_sentinels(messages, i))
        for r, variant in zip(owners, self._render_many(variants, tools), strict=True):
            span = turn_span(self._control_re, fulls[r], variant)
            if span is None or (spans[r] and span[0] < spans[r][-1][1]):
                unlocated[r] += 1
            else:
                spans[r].append(span)
        return [_Plan(fulls[r], spans[r], unlocated[r]) for r in range(len(batch))]

    def _render_many(
        self, conversations: list[list[Message]], tools: list[dict[str, Any]] | None = None
    ) -> list[str]:
        if not conversations:
            return []
        texts = self.tokenizer.apply_chat_template(
            conversations,
            tools=tools,
            tokenize=False,
            add_generation_prompt=False,
            **self.template_kwargs,
        )
        return [str(t) for t in texts]


def apply_think_rule(text: str, spans: list[Span]) -> list[Span]:
    """A span that opens a non-empty think block starts at its `<think>`; empty blocks never count.

    The sentinel diff starts a reasoning turn's span after `<think>\\n` (the tag is constant
    text); a generation span may start with an empty block. Both are moved to the same rule.
    """
    out: list[Span] = []
    floor = 0
    for a, b in spans:
        opening = _THINK_OPEN_BEFORE.search(text, max(floor, a - _THINK_LOOKBACK), a)
        if opening is not None:
            a = opening.start()
        empty = _EMPTY_THINK.match(text, a)
        if empty is not None and empty.end() < b:
            a = empty.end()
        out.append((a, b))
        floor = b
    return out


def reasoning_dropped(row: Conversation, text: str) -> int:
    """Assistant turns (the trained ones) whose reasoning text is absent from the rendering."""
    dropped = 0
    for message in _trained(row):
        if has_reasoning(message):
            thought = _reasoning_text(message).strip()
            if thought and thought not in text:
                dropped += 1
    return dropped


def think_in_content(row: Conversation, text: str) -> str | None:
    """The first trained assistant turn whose plain content holds `</think>` and that the
    template rewrote (Qwen3, like transformers, makes the text before it a think block, trained
    as reasoning): `message 3: '...use </think> to close...'`. Content that opens with `<think>`
    is the inline reasoning form, and a template that renders the content as it is changed
    nothing: neither is reported."""
    first = len(row.messages) - 1 if row.last_turn_only else 0
    for k in range(first, len(row.messages)):
        message = row.messages[k]
        content = message["content"]
        if message["role"] != "assistant" or message.get("reasoning_content"):
            continue
        if THINK_CLOSE not in content or content.lstrip().startswith(THINK_OPEN):
            continue
        if content in text:
            continue
        at = content.index(THINK_CLOSE)
        start, end = max(0, at - 40), at + len(THINK_CLOSE) + 40
        snippet = (
            ("..." if start else "") + content[start:end] + ("..." if end < len(content) else "")
        )
        return f"message {k}: {snippet!r}"
    return None


def _trained(row: Conversation) -> list[Message]:
    return row.messages[-1:] if row.last_turn_only else row.messages


def _reasoning_text(message: Message) -> str:
    if message.get("reasoning_content"):
        return str(message["reasoning_content"])
    content: str = message["content"]
    head = content.split(THINK_CLOSE)[0]
    return head.split(THINK_OPEN)[-1]


def _isolated(
    work: Callable[[list[In]], Sequence[T]], items: list[In], reason: str
) -> list[T | Rejected]:
    """`work` over the whole batch (fast path); if that raises, item by item, so only the items
    that fail themselves become Rejected (a property of the row, never of the import)."""
    try:
        return list(work(items))
    except Exception:  # a bad row broke the batch: redo row by row to isolate it
        pass
    out: list[T | Rejected] = []
    for item in items:
        try:
            out.extend(work([item]))
        except Exception as exc:
            out.append(Rejected(reason, _one_line(exc)))
    return out


def _text(plan: _Plan | Rejected) -> str:
    assert isinstance(plan, _Plan)
    return plan.text


def _tools_key(tools: list[dict[str, Any]] | None) -> str:
    return "" if tools is None else json.dumps(tools, sort_keys=True, ensure_ascii=False)


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
