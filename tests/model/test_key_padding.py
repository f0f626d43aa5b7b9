"""Dense DFlash masks carry a multiple of KEY_MULTIPLE keys (CPU SDPA is ~20 % cheaper per
score there); the drafter pads K/V with zero keys the mask hides, so nothing else changes."""

from __future__ import annotations

import torch

from tests.model.helpers import make_batch, make_drafter
from trainer.model.attention import build_mask, pad_keys
from trainer.model.key_widths import KEY_MULTIPLE
from trainer.model.masks import dense_dflash_mask, sample_anchors
from trainer.model.target import TargetModel


def test_the_sdpa_mask_is_the_dense_mask_with_hidden_keys_appended() -> None:
    for seq, n in [(13, 3), (16, 2), (30, 5)]:
        anchors = torch.sort(torch.randperm(seq - 1)[:n] + 1).values[None].repeat(2, 1)
        valid = torch.ones(2, seq, dtype=torch.long)
        dense = dense_dflash_mask(anchors, valid, 4)
        got = build_mask(anchors, valid, 4, "sdpa")
        assert isinstance(got, torch.Tensor)
        keys = dense.shape[-1]
        assert got.shape[-1] % KEY_MULTIPLE == 0 and keys <= got.shape[-1] < keys + KEY_MULTIPLE
        assert torch.equal(got[..., :keys], dense) and not got[..., keys:].any()
    exact = torch.ones(1, 1, 2, 32, dtype=torch.bool)
    assert pad_keys(exact) is exact


def test_padded_keys_change_no_output(target: TargetModel) -> None:
    """The drafter's block states with the padded mask equal those with the exact one (and the
    flex path, which pads nothing)."""
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch()
    feats = target.capture(ids, attn)
    anchors = sample_anchors(loss, attn, 5, torch.Generator().manual_seed(1))
    pos = anchors.positions
    block_ids = drafter.block_input_ids(ids.gather(1, pos))
    block_pos = (pos[:, :, None] + torch.arange(4)).flatten(1)
    exact = dense_dflash_mask(pos, attn, 4)
    padded = build_mask(pos, attn, 4, "sdpa")
    assert isinstance(padded, torch.Tensor) and padded.shape[-1] > exact.shape[-1]
    with torch.no_grad():
        a = drafter(feats, block_ids, block_pos, exact)
        b = drafter(feats, block_ids, block_pos, padded)
        c = drafter(feats, block_ids, block_pos, build_mask(pos, attn, 4, "flex"))
    torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(c, a, rtol=1e-5, atol=1e-5)
