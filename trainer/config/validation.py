"""Pydantic validation errors as one line that names every offending key.

Configs, inventories, manifests and exports all report a bad file as ``FILE: key: reason``; this
is the one place that turns a ``ValidationError`` into that ``key: reason`` part.  All problems
are named (up to a few), so a file with three mistakes is not fixed one rerun at a time.
A wrong type also shows what was given (``max_batch: Input should be a valid integer, got
true``), since TOML's ``64`` / ``"64"`` / ``64.0`` / ``true`` look alike in a message.

``STRICT`` is the model-config part every user-written file shares: no coercion (a boolean, a
string or a float is never taken for an integer; an int is still a valid float) and no
non-finite floats (``inf``/``nan`` are TOML literals). ``utf8_text`` decodes a file's bytes or
names the byte offset where it stops being UTF-8.
Torch-free: the operator side imports it too.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from pydantic import ConfigDict, ValidationError

from trainer.errors import TrainerError

__all__ = ["STRICT", "NotUtf8Error", "dotted", "one_line", "utf8_text"]

_PLAIN = {"extra_forbidden": "unknown key (typo?)", "missing": "required key is missing"}

# Merge into a model's config: ``ConfigDict(**STRICT, extra="forbid", frozen=True)``.
STRICT: ConfigDict = ConfigDict(strict=True, allow_inf_nan=False)


def dotted(loc: Sequence[int | str], root: str = "<top>") -> str:
    """`optimizer.lr` from pydantic's location tuple; `root` for the document itself."""
    return ".".join(str(part) for part in loc) or root


def _shown(value: Any) -> str:
    """A given value as the user wrote it (TOML spelling for booleans, quotes for strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if value != value else ("inf" if value > 0 else "-inf")
    if isinstance(value, str | int | float):
        text = repr(value) if not isinstance(value, str) else f'"{value}"'
        return text if len(text) <= 40 else text[:37] + "..."
    return f"a {type(value).__name__}"


def _reason(error: Any) -> str:
    kind = error["type"]
    if kind in _PLAIN:
        return _PLAIN[kind]
    msg = str(error["msg"])
    if kind.endswith("_type") or kind == "finite_number":
        msg += f", got {_shown(error.get('input'))}"
    return msg


def one_line(
    err: ValidationError,
    *,
    key: Callable[[Sequence[int | str]], str] = dotted,
    limit: int = 3,
) -> str:
    """``key: reason; key: reason (+N more)`` for the first `limit` errors, on one line."""
    errors = err.errors(include_url=False)
    parts = [f"{key(e['loc'])}: {_reason(e)}".replace("\n", " ") for e in errors[:limit]]
    more = len(errors) - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")


class NotUtf8Error(TrainerError, ValueError):
    """A file that is not UTF-8 text; the message names the byte offset (and its line)."""

    def __init__(self, err: UnicodeDecodeError) -> None:
        line = err.object[: err.start].count(b"\n") + 1
        byte = err.object[err.start]
        super().__init__(
            f"not UTF-8 text at byte {err.start} (line {line}): {err.reason} 0x{byte:02x}"
        )
        self.offset = err.start
        self.line = line


def utf8_text(data: bytes) -> str:
    """``data`` decoded as UTF-8 (a BOM is not skipped); NotUtf8Error names the byte offset."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise NotUtf8Error(err) from None
