"""The objective selects its valid slots by index, not by boolean mask (issue 16 item 4):
`x[valid]` reads the mask back to size its result (a device sync, one more in backward), five
per micro-step. The sums and gradients are the boolean-mask formulation's bit for bit, with
the valid slots known on the host (`host_masks`) or found once on the device."""

from __future__ import annotations

import torch
from torch import Tensor

from tests.model.helpers import make_batch, make_drafter
from trainer.kernels import lm_head_cross_entropy
from trainer.model.attention import build_mask
from trainer.model.drafter import DFlashDrafter, default_gamma
from trainer.model.losses import slot_weights
from trainer.model.masks import Anchors, sample_anchors
from trainer.model.objective import StepResult, block_labels, dflash_objective, streaks
from trainer.model.target import TargetModel


def _boolean_mask_objective(
    drafter: DFlashDrafter, ids: Tensor, loss: Tensor, attn: Tensor, feats: Tensor, a: Anchors
) -> StepResult:
    """The objective as it was written before (x[valid] selections), unpacked rows."""
    bsz = drafter.config.block_size
    pos = a.positions
    block_ids = drafter.block_input_ids(ids.gather(1, pos))
    block_pos = (pos[:, :, None] + torch.arange(bsz)).flatten(1)
    out = drafter(feats, block_ids, block_pos, build_mask(pos, attn, bsz, "sdpa"))
    labels, valid = block_labels(ids, loss, attn, a, bsz)
    out = out.view(*pos.shape, bsz, -1)[:, :, 1:]
    head = drafter.lm_head.weight
    ce = lm_head_cross_entropy(out[valid].to(head.dtype), head, labels[valid], backend="chunked")
    w_slot = slot_weights(bsz, default_gamma(bsz)).expand_as(valid)[valid]
    correct = torch.zeros_like(valid)
    correct[valid] = ce.correct
    block_streak = streaks(correct, valid)
    has_pred = valid.any(-1)
    return StepResult(
        loss_sum=(ce.loss * w_slot).sum(),
        weight_sum=w_slot.sum(),
        n_correct=ce.correct.sum(),
        n_pred=valid.sum(),
        streak_sum=block_streak[has_pred].sum(),
        n_blocks=has_pred.sum(),
        pos_correct=correct.sum((0, 1)),
        pos_count=valid.sum((0, 1)),
    )


def _grads(drafter: DFlashDrafter, res: StepResult) -> list[Tensor]:
    drafter.zero_grad(set_to_none=True)
    torch.autograd.backward(res.loss_sum)
    return [p.grad.clone() for p in drafter.parameters() if p.grad is not None]


def test_index_selection_is_the_boolean_mask_selection_bit_for_bit(target: TargetModel) -> None:
    drafter = make_drafter(target, block_size=4)
    ids, loss, attn = make_batch(rows=3)
    loss[2, 10:] = 0  # an unsupervised tail: blocks with invalid slots, a padded anchor column
    feats = target.capture(ids, attn)
    anchors = sample_anchors(loss, attn, 7, torch.Generator().manual_seed(3))
    assert not bool(anchors.keep.all())  # some padding blocks
    ref = _boolean_mask_objective(drafter, ids, loss, attn, feats, anchors)
    ref_grads = _grads(drafter, ref)
    for host_masks in (None, (loss.clone(), attn.clone(), None)):
        res = dflash_objective(
            drafter,
            None,
            ids,
            loss,
            attn,
            feats,
            anchors=anchors,
            attn_backend="sdpa",
            ce_backend="chunked",
            host_masks=host_masks,
        )
        for name in ref.metric_tensors():
            assert torch.equal(getattr(res, name).detach(), getattr(ref, name).detach()), name
        got = _grads(drafter, res)
        assert len(got) == len(ref_grads)
        assert all(torch.equal(g, r) for g, r in zip(got, ref_grads, strict=True))
