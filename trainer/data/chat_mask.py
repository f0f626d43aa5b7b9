"""Tokenise conversations with the target's chat template and mark the assistant tokens.

Two strategies, chosen per template (the chosen one is recorded in the store manifest):

* ``generation-tags``: the template wraps assistant output in ``{% generation %}`` blocks
  (ModelOpt's patched Qwen3 template, many newer templates). Transformers then reports the exact
  character spans it rendered inside them, and a token is supervised when it overlaps a span.
  The template decides what counts: typically content plus the end-of-turn token.
* ``incremental-prefix`` (any other template): for assistant message i, render
  ``messages[:i]`` with the generation prompt (ends right after the assistant header) and
  ``messages[:i+1]`` (ends after the turn's closing text). The characters between the two,
  minus trailing whitespace, are the turn: content + end-of-turn token (e.g. ``<|im_end|>``),
  but not the newline that separates turns, which the template, not the model, writes. Both
  renders must be prefixes of the full conversation's render; a template that rewrites earlier
  turns (Qwen3 drops old reasoning) breaks that for those turns, which then stay unsupervised
  and are counted as ``unstable_turns`` rather than guessed at.

The overlap rule matches transformers' own so both strategies agree on the same template.
Content that contains the tokenizer's special tokens (e.g. a literal ``<|im_end|>``) would be
encoded as control tokens and silently change the turn structure, so such rows are rejected.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from trainer.data.conversations import Message, Rejected

GENERATION_TAGS = "generation-tags"
INCREMENTAL_PREFIX = "incremental-prefix"
TEMPLATE_ERROR = "template_error"
CONTROL_TOKEN_IN_CONTENT = "control_token_in_content"

_GENERATION_RE = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class Encoded:
    """One tokenised conversation: ids, aligned loss mask, and turns left unsupervised."""

    tokens: np.ndarray  # int32
    mask: np.ndarray  # uint8, 1 on assistant tokens
    unstable_turns: int = 0


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
        self.strategy = GENERATION_TAGS if _GENERATION_RE.search(template) else INCREMENTAL_PREFIX
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
            encoded = self._encode_incremental(batch)
        for i, result in zip(todo, encoded, strict=True):
            results[i] = result
        return [r for r in results if r is not None]

    def _control_token(self, messages: list[Message]) -> str | None:
        if self._control_re is None:
            return None
        for message in messages:
            for key in ("content", "reasoning_content"):
                found = self._control_re.search(message.get(key, ""))
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

    # -- incremental prefixes ---------------------------------------------------------------

    def _encode_incremental(self, batch: list[list[Message]]) -> list[Encoded | Rejected]:
        plans: list[tuple[str, list[tuple[int, int]], int] | Rejected]
        try:  # all renders of the chunk in three batched template calls
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
            _, spans, unstable = plan
            ids, offsets = encodings["input_ids"][k], encodings["offset_mapping"][k]
            k += 1
            mask = mask_from_spans(offsets, spans)
            results.append(Encoded(np.asarray(ids, dtype=np.int32), mask, unstable_turns=unstable))
        return results

    def _plan_spans(
        self, batch: list[list[Message]]
    ) -> list[tuple[str, list[tuple[int, int]], int]]:
        """Full text, assistant character spans and unstable-turn count for each conversation."""
        fulls = self._render_many(batch, generation_prompt=False)
        owners: list[int] = []
        befores: list[list[Message]] = []
        afters: list[list[Message]] = []
        unstable = [0] * len(batch)
        for r, messages in enumerate(batch):
            for i, message in enumerate(messages):
                if message["role"] != "assistant":
                    continue
                if i == 0:  # nothing renders before it: its start cannot be located
                    unstable[r] += 1
                    continue
                owners.append(r)
                befores.append(messages[:i])
                afters.append(messages[: i + 1])
        spans: list[list[tuple[int, int]]] = [[] for _ in batch]
        before_texts = self._render_many(befores, generation_prompt=True)
        after_texts = self._render_many(afters, generation_prompt=False)
        for r, before, after_raw in zip(owners, before_texts, after_texts, strict=True):
            after = after_raw.rstrip()
            row = spans[r]
            if (
                len(after) > len(before)
                and after.startswith(before)
                and fulls[r].startswith(after)
                and (not row or row[-1][1] <= len(before))
            ):
                row.append((len(before), len(after)))
            else:
                unstable[r] += 1
        return [(fulls[r], spans[r], unstable[r]) for r in range(len(batch))]

    def _render_many(
        self, conversations: list[list[Message]], *, generation_prompt: bool
    ) -> list[str]:
        if not conversations:
            return []
        texts = self.tokenizer.apply_chat_template(
            conversations,
            tokenize=False,
            add_generation_prompt=generation_prompt,
            **self.template_kwargs,
        )
        return [str(t) for t in texts]


def _encoded(ids: Any, mask: Any) -> Encoded:
    return Encoded(np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.uint8))


def _one_line(exc: BaseException) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
