"""Small builders shared by the model tests."""

from __future__ import annotations

import torch

from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.target import TargetModel

MASK_ID = 511  # the tiny target's top row; the test data draws ids below 500


def make_drafter(
    target: TargetModel,
    *,
    block_size: int = 4,
    num_layers: int = 2,
    seed: int = 0,
    mask_token_id: int = MASK_ID,
) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.from_target(
        target,
        mask_token_id=mask_token_id,
        num_layers=num_layers,
        block_size=block_size,
        initializer_range=0.1,
    )
    return DFlashDrafter(cfg, target.embed_tokens, target.lm_head)


def make_batch(
    rows: int = 2, seq: int = 32, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random ids, a prompt of 6 unsupervised tokens, and row 1 right-padded by 7."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 500, (rows, seq), generator=g)
    attn = torch.ones_like(ids)
    loss = torch.ones_like(ids)
    loss[:, :6] = 0
    if rows > 1:
        attn[1, seq - 7 :] = 0
        loss[1, seq - 7 :] = 0
        ids[1, seq - 7 :] = 0
    return ids, loss, attn
