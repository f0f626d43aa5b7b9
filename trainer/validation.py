"""Pydantic validation errors as one line that names every offending key.

Configs, inventories, manifests and exports all report a bad file as ``FILE: key: reason``; this
is the one place that turns a ``ValidationError`` into that ``key: reason`` part.  All problems
are named (up to a few), so a file with three mistakes is not fixed one rerun at a time.
Torch-free: the operator side imports it too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from pydantic import ValidationError

__all__ = ["one_line"]

_PLAIN = {"extra_forbidden": "unknown key (typo?)", "missing": "required key is missing"}


def dotted(loc: Sequence[int | str], root: str = "<top>") -> str:
    """`optimizer.lr` from pydantic's location tuple; `root` for the document itself."""
    return ".".join(str(part) for part in loc) or root


def one_line(
    err: ValidationError,
    *,
    key: Callable[[Sequence[int | str]], str] = dotted,
    limit: int = 3,
) -> str:
    """``key: reason; key: reason (+N more)`` for the first `limit` errors, on one line."""
    errors = err.errors(include_url=False)
    parts = [
        f"{key(e['loc'])}: {_PLAIN.get(e['type'], e['msg'])}".replace("\n", " ")
        for e in errors[:limit]
    ]
    more = len(errors) - limit
    return "; ".join(parts) + (f" (+{more} more)" if more > 0 else "")
