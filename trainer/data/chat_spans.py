"""Where an assistant turn's text lies in a rendered conversation: the ``sentinel-diff``
strategy's pure text logic (see `trainer.data.chat_mask`, which renders and tokenises).

A turn's content (and reasoning) is swapped for a sentinel and the conversation rendered again;
the characters where the real render and the sentinel render differ are that turn's text, and
the control token right after it (its end of turn) is supervised with it. `control` is the
tokenizer's special tokens as one pattern (None when it has none): content holding them is
rejected before any of this runs, so a control token inside a difference came from the
template, and a span crossing one is not a turn.
"""

from __future__ import annotations

import re

from trainer.data.conversations import Message, has_reasoning

# Private-use code points: never produced by real text, and distinct from each other so the
# template's own handling (strip, split) cannot merge them with neighbouring characters.
CONTENT_SENTINEL = "\ue000dflash-content\ue001"
REASONING_SENTINEL = "\ue002dflash-reasoning\ue003"
_TURN_SENTINEL_RE = re.compile("\ue004dflash-turn-(\\d+)\ue005")
THINK_OPEN = "<think>"
THINK_CLOSE = "</think>"

Span = tuple[int, int]


def spans_one_pass(
    control: re.Pattern[str] | None, full: str, variant: str, turns: int
) -> list[Span | None] | None:
    """Per-turn spans from the all-sentinel render (`all_turn_sentinels`), or None when it
    cannot decide."""
    if control is None:
        return None
    parts = _TURN_SENTINEL_RE.split(variant)
    constants, order = parts[0::2], parts[1::2]
    if order != [str(k) for k in range(turns)] or not full.startswith(constants[0]):
        return None
    pos = len(constants[0])
    found: list[Span | None] = []
    for k, after in enumerate(constants[1:], start=1):
        if k == len(constants) - 1:
            end = len(full) - len(after)
            if end < pos or full[end:] != after:
                return None
        else:
            # Searching needs an anchor content cannot contain: a control token.
            end = full.find(after, pos) if control.search(after) else -1
            if end < 0:
                return None
        if control.search(full, pos, end):
            return None
        found.append(closed_span(control, full, pos, end))
        pos = end + len(after)
    return found


def turn_span(control: re.Pattern[str] | None, full: str, variant: str) -> Span | None:
    """Where `full` differs from the sentinel render (`with_sentinels`), plus the end-of-turn
    token after it."""
    if variant.count(CONTENT_SENTINEL) != 1:
        return None
    start = common_prefix(full, variant)
    tail = common_suffix(full[start:], variant[start:])
    end = len(full) - tail
    # The difference must end with the content, and must not cross a turn boundary: control
    # tokens inside it came from the template (content holding them is rejected earlier),
    # so the template used this turn's text somewhere far from the turn itself.
    if not variant[: len(variant) - tail].endswith(CONTENT_SENTINEL):
        return None
    if control is not None and control.search(full, start, end):
        return None
    return closed_span(control, full, start, end)


def closed_span(control: re.Pattern[str] | None, full: str, start: int, end: int) -> Span | None:
    """Extend a turn's text by the control token right after it (its end-of-turn)."""
    if control is not None:
        closing = control.match(full, end)
        if closing is not None:
            end = closing.end()
    return (start, end) if end > start else None


def all_turn_sentinels(messages: list[Message]) -> list[Message] | None:
    """Every assistant content replaced by a numbered sentinel (None if a turn has reasoning)."""
    out: list[Message] = []
    k = 0
    for message in messages:
        if message["role"] == "assistant":
            if has_reasoning(message):
                return None
            message = _without_tool_calls({**message, "content": f"\ue004dflash-turn-{k}\ue005"})
            k += 1
        out.append(message)
    return out


def _without_tool_calls(message: Message) -> Message:
    """Tool calls are model output too: dropping them from the sentinel render makes their
    rendered text part of the difference, so it is supervised with the content."""
    message.pop("tool_calls", None)
    return message


def with_sentinels(messages: list[Message], i: int) -> list[Message]:
    """`messages` with turn `i`'s content (and reasoning) swapped for the sentinels."""
    original = messages[i]
    turn = _without_tool_calls({**original, "content": CONTENT_SENTINEL})
    if "reasoning_content" in turn:
        turn["reasoning_content"] = REASONING_SENTINEL
    elif THINK_CLOSE in original["content"]:
        turn["content"] = _inline_think_sentinels(original["content"])
    return [*messages[:i], turn, *messages[i + 1 :]]


def _inline_think_sentinels(content: str) -> str:
    """`<think>\\nidea\\n</think>\\n\\nanswer` -> the same shape with both parts swapped, so a
    template that moves inline reasoning into its think block (Qwen3) still parses it."""
    head, _, _ = content.partition(THINK_CLOSE)
    answer = content.rsplit(THINK_CLOSE, 1)[1]
    opening = head.rfind(THINK_OPEN)
    prefix = head[: opening + len(THINK_OPEN)] if opening >= 0 else ""
    thought = head[len(prefix) :]
    lead = thought[: len(thought) - len(thought.lstrip())]
    trail = thought[len(thought.rstrip()) :]
    gap = answer[: len(answer) - len(answer.lstrip())]
    return f"{prefix}{lead}{REASONING_SENTINEL}{trail}{THINK_CLOSE}{gap}{CONTENT_SENTINEL}"


def common_prefix(a: str, b: str) -> int:
    """Length of the common prefix, by bisection on C-speed slice comparisons."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def common_suffix(a: str, b: str) -> int:
    """Length of the common suffix (see `common_prefix`)."""
    lo, hi = 0, min(len(a), len(b))
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[len(a) - mid :] == b[len(b) - mid :]:
            lo = mid
        else:
            hi = mid - 1
    return lo
