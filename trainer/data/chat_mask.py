"""Tokenise conversations with the target's chat template and mark the assistant tokens.

Two strategies, chosen per template (the chosen one is recorded in the store manifest):

* ``generation-tags``: the template wraps assistant output in ``{% generation %}`` blocks
  (ModelOpt's patched Qwen3 template, many newer templates). Transformers then reports the exact
  character spans it rendered inside them, and a token is supervised when it overlaps a span.
  The template decides what counts: typically content plus the end-of-turn token.
* ``sentinel-diff`` (any other template): render the whole conversation once, then once more
  per assistant turn with that turn's content (and reasoning, if any) replaced by a sentinel.
  The characters where the two renders differ are exactly the text the template derived from
  that turn, wherever it put it and however it rewrote the rest (Qwen3 renders history without
  the think block it gives the final turn); the control token right after it (the end of turn,
  e.g. ``<|im_end|>``) is supervised too, because the drafter must learn to stop. Headers, the
  newline between turns and template boilerplate such as an empty ``<think></think>`` are not.
  A turn the template does not render, or whose text shows up anywhere but in one place, is
  left unsupervised and counted (``unlocated_turns``) rather than guessed at.

The overlap rule matches transformers' own so both strategies agree on the same template.
Content that contains the tokenizer's special tokens (e.g. a literal ``<|im_end|>``) would be
encoded as control tokens and silently change the turn structure, so such rows are rejected.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.data.conversations import Message, Rejected

GENERATION_TAGS = "generation-tags"
SENTINEL_DIFF = "sentinel-diff"
TEMPLATE_ERROR = "template_error"
CONTROL_TOKEN_IN_CONTENT = "control_token_in_content"

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Private-use code points: never produced by real text, and distinct from each other so the
# template's own handling (strip, split) cannot merge them with neighbouring characters.
CONTENT_SENTINEL = "\ue000dflash-content\ue001"
REASONING_SENTINEL = "\ue002dflash-reasoning\ue003"
_TURN_SENTINEL_RE = re.compile("\ue004dflash-turn-(\\d+)\ue005")


@dataclass(frozen=True)
class Encoded:
    """One tokenised conversation: ids, aligned loss mask, and turns left unsupervised."""

    tokens: np.ndarray  # int32
    mask: np.ndarray  # uint8, 1 on assistant tokens
    unlocated_turns: int = 0


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


class ChatEncoder:
    """Turns normalised messages into (tokens, mask) with one tokenizer and chat template."""

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

    def encode_batch(self, conversations: list[list[Message]]) -> list[Encoded | Rejected]:
        """Encode many conversations; a bad one becomes a Rejected, never an exception."""
        results: list[Encoded | Rejected | None] = [None] * len(conversations)
        todo: list[int] = []
        for i, messages in enumerate(conversations):
            hit = self._control_token(messages)
            if hit is not None:
                results[i] = Rejected(CONTROL_TOKEN_IN_CONTENT, f"content contains {hit!r}")
            else:
                todo.append(i)
        batch = [conversations[i] for i in todo]
        if self.strategy == GENERATION_TAGS:
            encoded = self._encode_generation_tags(batch)
        else:
            encoded = self._encode_sentinel_diff(batch)
        for i, result in zip(todo, encoded, strict=True):
            results[i] = result
        return [r for r in results if r is not None]

    def _control_token(self, messages: list[Message]) -> str | None:
        if self._control_re is None:
            return None
        for message in messages:
            texts = [message["content"], message.get("reasoning_content", "")]
            if "tool_calls" in message:
                texts.append(json.dumps(message["tool_calls"], ensure_ascii=False))
            for text in texts:
                found = self._control_re.search(text)
                if found:
                    return found.group(0)
        return None

    # -- generation tags --------------------------------------------------------------------

    def _encode_generation_tags(self, batch: list[list[Message]]) -> list[Encoded | Rejected]:
        if not batch:
            return []
        try:  # one batched call (fast path: one Rust tokenisation over the chunk)
            out = self._apply_with_mask(batch)
        except Exception:  # a bad row broke the batch: redo row by row to isolate it
            out = None
        if out is not None:
            pairs = zip(out["input_ids"], out["assistant_masks"], strict=True)
            return [_encoded(ids, mask) for ids, mask in pairs]
        results: list[Encoded | Rejected] = []
        for messages in batch:
            try:
                out = self._apply_with_mask([messages])
                results.append(_encoded(out["input_ids"][0], out["assistant_masks"][0]))
            except Exception as exc:  # a template error is a property of the row
                results.append(Rejected(TEMPLATE_ERROR, _one_line(exc)))
        return results

    def _apply_with_mask(self, batch: list[list[Message]]) -> Any:
        return self.tokenizer.apply_chat_template(
            batch,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            **self.template_kwargs,
        )

    # -- sentinel diff -------------------------------------------------------------------

    def _encode_sentinel_diff(self, batch: list[list[Message]]) -> list[Encoded | Rejected]:
        plans: list[tuple[str, list[tuple[int, int]], int] | Rejected]
        try:  # all renders of the chunk in two batched template calls
            plans = list(self._plan_spans(batch))
        except Exception:  # a bad row broke the batch: redo row by row to isolate it
            plans = []
            for messages in batch:
                try:
                    plans.extend(self._plan_spans([messages]))
                except Exception as exc:  # a template error is a property of the row
                    plans.append(Rejected(TEMPLATE_ERROR, _one_line(exc)))
        texts = [p[0] for p in plans if not isinstance(p, Rejected)]
        encodings = (
            self.tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
            if texts
            else {"input_ids": [], "offset_mapping": []}
        )
        results: list[Encoded | Rejected] = []
        k = 0
        for plan in plans:
            if isinstance(plan, Rejected):
                results.append(plan)
                continue
            _, spans, unlocated = plan
            ids, offsets = encodings["input_ids"][k], encodings["offset_mapping"][k]
            k += 1
            mask = mask_from_spans(offsets, spans)
            results.append(
                Encoded(np.asarray(ids, dtype=np.int32), mask, unlocated_turns=unlocated)
            )
        return results

    def _plan_spans(
        self, batch: list[list[Message]]
    ) -> list[tuple[str, list[tuple[int, int]], int]]:
        """Full text, assistant character spans and unlocated-turn count per conversation.

        Fast path: one extra render with every assistant turn swapped for its own numbered
        sentinel; if the constant text between sentinels (which holds the turn's control
        tokens) re-appears in order in the real render, the gaps are the turns. Templates whose
        text around a turn depends on its content, or that drop or repeat turns, fall back to
        one render per turn (the diff against a single swapped turn).
        """
        fulls = self._render_many(batch)
        spans: list[list[tuple[int, int]]] = [[] for _ in batch]
        unlocated = [0] * len(batch)
        quick = [(r, v) for r, m in enumerate(batch) if (v := _all_turn_sentinels(m)) is not None]
        rendered = self._render_many([v for _, v in quick])
        slow = set(range(len(batch)))
        for (r, _), text in zip(quick, rendered, strict=True):
            turns = sum(m["role"] == "assistant" for m in batch[r])
            found = self._spans_one_pass(fulls[r], text, turns)
            if found is not None:
                slow.discard(r)
                spans[r] = [span for span in found if span is not None]
                unlocated[r] = found.count(None)
        owners: list[int] = []
        variants: list[list[Message]] = []
        for r in sorted(slow):
            for i, message in enumerate(batch[r]):
                if message["role"] == "assistant":
                    owners.append(r)
                    variants.append(_with_sentinels(batch[r], i))
        for r, variant in zip(owners, self._render_many(variants), strict=True):
            span = self._turn_span(fulls[r], variant)
            if span is None or (spans[r] and span[0] < spans[r][-1][1]):
                unlocated[r] += 1
            else:
                spans[r].append(span)
        return [(fulls[r], spans[r], unlocated[r]) for r in range(len(batch))]

    def _spans_one_pass(
        self, full: str, variant: str, turns: int
    ) -> list[tuple[int, int] | None] | None:
        """Per-turn spans from the all-sentinel render, or None when it cannot decide."""
        if self._control_re is None:
            return None
        parts = _TURN_SENTINEL_RE.split(variant)
        constants, order = parts[0::2], parts[1::2]
        if order != [str(k) for k in range(turns)] or not full.startswith(constants[0]):
            return None
        pos = len(constants[0])
        found: list[tuple[int, int] | None] = []
        for k, after in enumerate(constants[1:], start=1):
            if k == len(constants) - 1:
                end = len(full) - len(after)
                if end < pos or full[end:] != after:
                    return None
            else:
                # Searching needs an anchor content cannot contain: a control token.
                end = full.find(after, pos) if self._control_re.search(after) else -1
                if end < 0:
                    return None
            if self._control_re.search(full, pos, end):
                return None
            found.append(self._closed_span(full, pos, end))
            pos = end + len(after)
        return found

    def _turn_span(self, full: str, variant: str) -> tuple[int, int] | None:
        """Where `full` differs from the sentinel render, plus the end-of-turn token after it."""
        if variant.count(CONTENT_SENTINEL) != 1:
            return None
        start = _common_prefix(full, variant)
        tail = _common_suffix(full[start:], variant[start:])
        end = len(full) - tail
        # The difference must end with the content, and must not cross a turn boundary: control
        # tokens inside it came from the template (content holding them is rejected earlier),
        # so the template used this turn's text somewhere far from the turn itself.
        if not variant[: len(variant) - tail].endswith(CONTENT_SENTINEL):
            return None
        if self._control_re is not None and self._control_re.search(full, start, end):
            return None
        return self._closed_span(full, start, end)

    def _closed_span(self, full: str, start: int, end: int) -> tuple[int, int] | None:
        """Extend a turn's text by the control token right after it (its end-of-turn)."""
        if self._control_re is not None:
            closing = self._control_re.match(full, end)
            if closing is not None:
                end = closing.end()
        return (start, end) if end > start else None

    def _render_many(self, conversations: list[list[Message]]) -> list[str]:
        if not conversations:
            return []
        texts = self.tokenizer.apply_chat_template(
            conversations, tokenize=False, add_generation_prompt=False, **self.template_kwargs
        )
        return [str(t) for t in texts]


def _all_turn_sentinels(messages: list[Message]) -> list[Message] | None:
    """Every assistant content replaced by a numbered sentinel (None if a turn has reasoning)."""
    out: list[Message] = []
    k = 0
    for message in messages:
        if message["role"] == "assistant":
            if "reasoning_content" in message:
                return None
            message = _without_tool_calls(dict(message, content=f"\ue004dflash-turn-{k}\ue005"))
            k += 1
        out.append(message)
    return out


def _without_tool_calls(message: Message) -> Message:
    """Tool calls are model output too: dropping them from the sentinel render makes their
    rendered text part of the difference, so it is supervised with the content."""
    message.pop("tool_calls", None)
    return message


def _with_sentinels(messages: list[Message], i: int) -> list[Message]:
    turn = _without_tool_calls(dict(messages[i], content=CONTENT_SENTINEL))
    if "reasoning_content" in turn:
        turn["reasoning_content"] = REASONING_SENTINEL
    return [*messages[:i], turn, *messages[i + 1 :]]


def _common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, by bisection on C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _common_suffix(a: str, b: str) -> int:
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _encoded(ids: Any, mask: Any) -> Encoded:
    return Encoded(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8))


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
