"""Print stored rows with the supervised spans marked, to eyeball a loss mask before training.

`python -m trainer.data show STORE [--count N | --rows I,J] [--tokenizer DIR]`: each row is
decoded run by run and supervised runs are wrapped in ⟦ ⟧. Chat-import stores decode with the
tokenizer recorded in the manifest (or `--tokenizer`); synthetic stores print token ids.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import pairwise
from pathlib import Path

import numpy as np

OPEN, CLOSE = "⟦", "⟧"
Decode = Callable[[list[int]], str]


def mask_runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
    """(start, end, supervised) for each maximal run of equal mask values."""
    if mask.size == 0:
        return []
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), int(mask.size)]
    return [(a, b, bool(mask[a])) for a, b in pairwise(bounds)]


def render_row(tokens: np.ndarray, mask: np.ndarray, decode: Decode) -> str:
    """The row as text with ⟦supervised⟧ runs; runs are decoded separately."""
    parts = []
    for a, b, supervised in mask_runs(mask):
        text = decode(tokens[a:b].tolist())
        parts.append(f"{OPEN}{text}{CLOSE}" if supervised else text)
    return "".join(parts)


def id_decoder(ids: list[int]) -> str:
    return " ".join(map(str, ids)) + " "


def tokenizer_decoder(directory: str) -> Decode:
    """Decode with a local tokenizer, special tokens kept (they are part of what is trained)."""
    from trainer.data.chat_import import load_tokenizer

    tokenizer = load_tokenizer(Path(directory))

    def decode(ids: list[int]) -> str:
        return str(tokenizer.decode(ids, skip_special_tokens=False))

    return decode
