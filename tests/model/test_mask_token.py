"""The mask token id is explicit and checked against the embedding and the data."""

from __future__ import annotations

import numpy as np
import pytest
from pydantic import ValidationError

from tests.model.helpers import make_drafter
from trainer.model.drafter import DrafterConfig
from trainer.model.mask_token import (
    MaskTokenError,
    mask_token_id_from_manifest,
    validate_mask_token_id,
)
from trainer.model.target import TargetModel


class _Manifest:
    def __init__(self, mask_token_id: int | None, reserved: list[int]) -> None:
        self.mask_token_id = mask_token_id
        self.reserved_token_ids = reserved


def test_mask_id_must_be_an_embedding_row() -> None:
    with pytest.raises(MaskTokenError, match="not a row"):
        validate_mask_token_id(512, 512)


def test_mask_id_must_not_occur_in_the_data() -> None:
    data = np.array([1, 2, 511, 3], dtype=np.int32)
    with pytest.raises(MaskTokenError, match=r"occurs 1 times in store/tokens\.i32"):
        validate_mask_token_id(511, 512, data_token_ids=data, source="store/tokens.i32")
    assert validate_mask_token_id(510, 512, data_token_ids=data) == 510


def test_manifest_reserved_ids_and_recorded_id_are_enforced() -> None:
    manifest = _Manifest(511, [510, 511])
    assert mask_token_id_from_manifest(manifest, 512) == 511
    with pytest.raises(MaskTokenError, match="disagrees"):
        mask_token_id_from_manifest(manifest, 512, explicit=510)
    with pytest.raises(MaskTokenError, match="reserves"):
        mask_token_id_from_manifest(_Manifest(None, [510]), 512, explicit=7)
    with pytest.raises(MaskTokenError, match="no mask_token_id"):
        mask_token_id_from_manifest(_Manifest(None, []), 512)


def test_drafter_config_rejects_a_mask_id_past_the_embedding(target: TargetModel) -> None:
    cfg = make_drafter(target).config
    with pytest.raises(ValidationError, match="not a row"):
        DrafterConfig(**{**cfg.model_dump(), "mask_token_id": 512})
