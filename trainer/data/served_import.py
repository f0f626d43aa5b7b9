"""The importer's side of regenerated files: the manifest check and stores from server ids.

`file_manifest` reads a file's first line (a regenerated file opens with its manifest);
`check_kwargs` refuses an import whose `--template-kwargs` contradict the mode the rows were
generated in (by name, before the tokenizer loads). `served_sample` is one store row built from
the server's ids (the prompt unsupervised, the generated ids supervised: exactly what the
target said, no re-tokenising) and `rerender_difference` says where the template's own
rendering of the same turn differs from them, for the summary's count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.chat_mask import Encoded
from trainer.data.conversations import Conversation, MetaRow
from trainer.data.errors import InputError
from trainer.data.served import RESUME_KEYS, RegenManifest, kwargs_mismatch
from trainer.data.sources import ChatSource

BAD_TOKEN_ID = "served_id_out_of_vocab"


def file_manifest(source: Path) -> RegenManifest | None:
    """The manifest on the file's first line (None: not a regenerated file); a manifest line
    that cannot be read is an InputError naming the file."""
    rows = iter(ChatSource(source))
    try:
        line, first = next(rows, (0, None))
    finally:
        close = getattr(rows, "close", None)
        if close is not None:
            close()
    if not isinstance(first, MetaRow):
        return None
    if first.manifest is None:
        raise InputError(f"{source}:{line}: {first.problem}")
    return first.manifest


def check_kwargs(source: Path, manifest: RegenManifest, kwargs: dict[str, Any]) -> set[str]:
    """The keys of `kwargs` that state the rows' mode (taken even when the template reads them
    only for a generation prompt); an InputError naming every key that contradicts it."""
    problems, declared = kwargs_mismatch(manifest, kwargs)
    if problems:
        raise InputError(f"--template-kwargs: {source} (regenerated): {'; '.join(problems)}")
    return declared


def check_later_manifest(source: Path, line: int, first: RegenManifest, meta: MetaRow) -> None:
    """A manifest line past the first (regenerated files concatenated): refused when it is
    unreadable or made its rows another way (the import would mix two distributions)."""
    if meta.manifest is None:
        raise InputError(f"{source}:{line}: {meta.problem}")
    differ = [k for k in RESUME_KEYS if getattr(first, k) != getattr(meta.manifest, k)]
    if differ:
        raise InputError(
            f"{source}:{line}: a second regeneration manifest whose {', '.join(differ)} differ "
            "from line 1's: the file joins rows generated two ways; import them separately"
        )


def served_sample(conversation: Conversation, vocab_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The store row of a one-generation conversation (`served_turns`): tokens = the prompt the
    server saw + what it generated, mask = 1 on the generated ids. ValueError for an id past
    the vocabulary."""
    assert conversation.served is not None and len(conversation.served) == 1
    gen = conversation.served[0]
    tokens = np.asarray(gen.prompt + gen.completion, dtype=np.int64)
    if int(tokens.max()) >= vocab_size:
        raise ValueError(f"token id {int(tokens.max())} is past the vocabulary ({vocab_size})")
    mask = np.zeros(tokens.size, dtype=np.uint8)
    mask[len(gen.prompt) :] = 1
    return tokens.astype(np.int32), mask


def rerender_difference(tokens: np.ndarray, rendered: Encoded) -> str | None:
    """Where the template's rendering of the same conversation (its final turn supervised)
    differs from the server's ids; None when the server's ids are a prefix of it and the rest
    is unsupervised (Qwen3 ends a turn with `<|im_end|>` + a newline no one generates)."""
    ids, mask = rendered.tokens, rendered.mask
    n = min(tokens.size, ids.size)
    unequal = np.flatnonzero(tokens[:n] != ids[:n])
    if unequal.size:
        at = int(unequal[0])
        return f"token {at} of {tokens.size}: server {int(tokens[at])}, template {int(ids[at])}"
    if ids.size < tokens.size:
        return f"the template renders {ids.size} tokens, the server saw {tokens.size}"
    if mask[tokens.size :].any():
        return (
            f"the template supervises {int(mask[tokens.size :].sum())} tokens past the server's end"
        )
    return None
