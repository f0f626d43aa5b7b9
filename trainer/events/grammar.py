"""One grammar for the trainer's lines: each line kind is a template, and both its formatter and
its parser are derived from that one template, so the printer and the readers cannot drift apart.

A template is literal text with ``{name}`` slots (`LineGrammar`); each slot is a model field,
printed and read back by its `Slot` (a regex group, a formatter, a parser). A line kind that
takes free ``key=value`` pairs ends in the extras tail, `` | k=v k=v`` (`format_extras`,
`parse_extras`). The parser is lenient about numbers: ``float()`` decides, so it reads back
anything the formatter prints (and a little more, e.g. ``1_0``).
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = [
    "ETA",
    "INT",
    "MISSING",
    "QUEUE",
    "UNKNOWN_ETA",
    "LineGrammar",
    "Slot",
    "check_extra",
    "format_eta",
    "format_extras",
    "number",
    "parse_eta",
    "parse_extras",
    "strict_eta",
]

MISSING = "---"  # a number field with no value yet
UNKNOWN_ETA = "???"

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Slot(Generic[T]):
    """How one slot's value is printed and read back.

    ``pattern`` holds exactly one capturing group, which always takes part in a match (an
    optional slot makes its group match the empty text); ``parse`` turns the group's text back
    into the value and raises ValueError when the text is not one.
    """

    pattern: str
    format: Callable[[T], str]
    parse: Callable[[str], T]


class LineGrammar:
    """A line kind: the template's literal text, its slots and (optionally) the extras tail.

    ``format`` fills the slots from a mapping (a model's fields); ``parse`` is its inverse:
    the slot values (and ``extra`` when the kind has a tail) of a line of this kind, or None.
    """

    def __init__(self, template: str, fields: Mapping[str, Slot[Any]], *, extras: bool) -> None:
        pattern: list[str] = []
        slots: list[tuple[str, Slot[Any]]] = []
        for literal, name, spec, conversion in string.Formatter().parse(template):
            pattern.append(re.escape(literal))
            if name is not None:
                if spec or conversion or name not in fields:
                    raise ValueError(f"{template!r}: slot {{{name}}} is not a plain field slot")
                slots.append((name, fields[name]))
                pattern.append(fields[name].pattern)
        if sorted(n for n, _ in slots) != sorted(fields):
            raise ValueError(f"{template!r}: its slots are not exactly {', '.join(fields)}")
        self._template = template
        self._slots = tuple(slots)
        self._parsers = tuple((name, f.parse) for name, f in slots)
        self._extras = extras
        # the tail after the last slot, checked by parse_extras; (.*) stops at a newline
        self.regex = re.compile("".join(pattern) + ("(.*)" if extras else ""))

    def format(self, values: Mapping[str, Any], extra: Mapping[str, str] | None = None) -> str:
        """The line (one line, no trailing newline)."""
        line = self._template.format_map({n: f.format(values[n]) for n, f in self._slots})
        return line + format_extras(extra)

    def parse(self, line: str) -> dict[str, Any] | None:
        """The slot values of ``line`` (plus ``extra`` for a kind with a tail); None if it is
        not a line of this kind."""
        m = self.regex.fullmatch(line)
        if m is None:
            return None
        groups = m.groups()
        try:  # zip stops after the slots' groups: the tail, if any, is the last group
            values = {
                name: parse(text)
                for (name, parse), text in zip(self._parsers, groups, strict=False)
            }
        except ValueError:
            return None
        if self._extras:
            extra = parse_extras(groups[-1])
            if extra is None:
                return None
            values["extra"] = extra
        return values


# --------------------------------------------------------------------------- extras tail

_BAD_KEY = re.compile(r"[\s=|]")
_BAD_VALUE = re.compile(r"\s")
_PAIR_RE = re.compile(r" ([^ =|]+)=([^ ]+)")


def check_extra(extra: dict[str, str]) -> dict[str, str]:
    """``extra`` unchanged; ValueError for a pair the tail could not carry (whitespace, '=')."""
    for k, val in extra.items():
        if not k or _BAD_KEY.search(k) or not val or _BAD_VALUE.search(val) or k == "|":
            raise ValueError(f"extra field {k!r}={val!r} is not a single key=value token")
    return extra


def format_extras(extra: Mapping[str, str] | None) -> str:
    """`` | k=v k=v`` in the mapping's order; empty for no pairs."""
    return " | " + " ".join(f"{k}={v}" for k, v in extra.items()) if extra else ""


def parse_extras(tail: str) -> dict[str, str] | None:
    """Inverse of format_extras: one or more `` | k=v k=v`` groups (merged; a later key wins);
    None unless every space-separated token is a ``key=value`` pair."""
    if not tail:
        return {}
    pairs = _PAIR_RE.findall(tail)
    if not tail.startswith(" | ") or len(pairs) != tail.count(" ") - tail.count(" | "):
        return None
    return dict(pairs)


# --------------------------------------------------------------------------- field kinds


def _fmt(value: float | None, spec: str) -> str:
    return MISSING if value is None else format(value, spec)


def _opt_float(text: str) -> float | None:
    return None if text == MISSING else float(text)


def number(spec: str) -> Slot[float | None]:
    """A number printed with ``spec`` (``---`` for None)."""
    return Slot(r"([^ ]+)", lambda v: _fmt(v, spec), _opt_float)


INT: Slot[int] = Slot(r"(\d+)", str, int)


def _format_queue(depths: Iterable[int]) -> str:
    return "[" + ", ".join(str(d) for d in depths) + "]"


def _parse_queue(text: str) -> list[int]:
    return [int(d) for d in text[1:-1].split(", ")] if len(text) > 2 else []


QUEUE: Slot[list[int]] = Slot(r"(\[(?:\d+(?:, \d+)*)?\])", _format_queue, _parse_queue)


def format_eta(seconds: float | None) -> str:
    """``17m`` under an hour, ``4.2h`` under a day, else ``12.3d``; ``???`` when unknown.

    The unit is chosen from the *rounded* text so that parse_eta(format_eta(x)) formats back to
    the same string (59.7 minutes prints ``1.0h``, never ``60m``).
    """
    if seconds is None or not math.isfinite(seconds):
        return UNKNOWN_ETA
    seconds = max(0.0, float(seconds))
    minutes = f"{seconds / 60:.0f}"
    if int(minutes) < 60:
        return f"{minutes}m"
    hours = f"{seconds / 3600:.1f}"
    if float(hours) < 24:
        return f"{hours}h"
    return f"{seconds / 86400:.1f}d"


_ETA_UNITS = {"m": 60.0, "h": 3600.0, "d": 86400.0}


def strict_eta(text: str) -> float | None:
    """The seconds of a printed ETA (``???`` -> None); ValueError for anything else."""
    if text == UNKNOWN_ETA:
        return None
    unit = _ETA_UNITS.get(text[-1:])
    eta = float(text[:-1]) * unit if unit else math.nan
    if not math.isfinite(eta):
        raise ValueError(f"bad ETA {text!r}")
    return eta


def parse_eta(text: str) -> float | None:
    """Inverse of format_eta (``???`` or anything unreadable -> None)."""
    try:
        return strict_eta(text)
    except ValueError:
        return None


ETA: Slot[float | None] = Slot(r"([^ ]+)", format_eta, strict_eta)
