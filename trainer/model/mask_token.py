"""Validation of the drafter's mask token id.

The id must be a row of the target embedding that the training data never contains: the
drafter learns to read that row as "unknown future token", so a reused pad/eos id or an id
past the embedding silently corrupts training (NeMo PR #2461 made it explicit for this
reason). The token store records the ids it guarantees absent in its manifest.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from trainer.errors import TrainerError


class MaskTokenError(TrainerError, ValueError):
    """An unusable mask token id; the message names the id and the source that rejects it."""


def validate_mask_token_id(
    mask_token_id: int,
    embedding_rows: int,
    *,
    data_token_ids: np.ndarray | Iterable[int] | None = None,
    reserved_token_ids: Iterable[int] | None = None,
    source: str = "data",
) -> int:
    """Check `mask_token_id` and return it.

    Args:
        mask_token_id: the explicit id (there is no default on purpose).
        embedding_rows: rows of the target input embedding (the padded vocabulary).
        data_token_ids: token ids the data contains (any array; scanned with numpy).
        reserved_token_ids: ids the data source guarantees absent; when given, the mask id
            must be one of them.
        source: names the data in error messages (a store path, a manifest file).
    """
    mid = int(mask_token_id)
    if not 0 <= mid < embedding_rows:
        raise MaskTokenError(
            f"mask_token_id {mid} is not a row of the target embedding (0..{embedding_rows - 1})"
        )
    if reserved_token_ids is not None:
        reserved = {int(i) for i in reserved_token_ids}
        if mid not in reserved:
            raise MaskTokenError(
                f"mask_token_id {mid} is not among the ids {source} reserves as absent "
                f"{sorted(reserved)}"
            )
    if data_token_ids is not None:
        tokens = np.asarray(
            data_token_ids if isinstance(data_token_ids, np.ndarray) else list(data_token_ids)
        )
        count = int(np.count_nonzero(tokens == mid))
        if count:
            raise MaskTokenError(f"mask_token_id {mid} occurs {count} times in {source}")
    return mid


def mask_token_id_from_manifest(
    manifest: object, embedding_rows: int, explicit: int | None = None, *, source: str = "manifest"
) -> int:
    """Resolve the mask id from a token-store manifest, checking an explicit id against it.

    The manifest's `mask_token_id` wins when `explicit` is None; a disagreement is an error
    (a resumed or exported drafter must keep the id it was trained with).
    """
    recorded = getattr(manifest, "mask_token_id", None)
    reserved = list(getattr(manifest, "reserved_token_ids", []) or [])
    if explicit is not None and recorded is not None and int(explicit) != int(recorded):
        raise MaskTokenError(
            f"mask_token_id {explicit} disagrees with {source} mask_token_id {recorded}"
        )
    chosen = explicit if explicit is not None else recorded
    if chosen is None:
        raise MaskTokenError(f"no mask_token_id given and none recorded in {source}")
    return validate_mask_token_id(
        chosen, embedding_rows, reserved_token_ids=reserved or None, source=source
    )
