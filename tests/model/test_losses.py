"""`[model.loss]`: D-PACE and logit distillation, each against an independent implementation
written here from the papers' formulas (plain torch on full logits, loops over the blocks, the
target's own HF logits as the teacher), loss and gradients; and the split step stays exact."""

from __future__ import annotations

import math
from dataclasses import fields

import pytest
import torch
from torch import Tensor

from tests.model.helpers import make_batch, make_drafter
from trainer.config import LossConfig
from trainer.model.attention import build_mask
from trainer.model.drafter import DFlashDrafter
from trainer.model.losses import dpace_weights
from trainer.model.masks import Anchors, sample_anchors
from trainer.model.objective import StepResult, dflash_objective
from trainer.model.split_step import bounded_objective_backward
from trainer.model.target import TargetModel

BLOCK = 4
GAMMA = 2.0


def _reference_loss(
    drafter: DFlashDrafter,
    feats: Tensor,
    ids: Tensor,
    loss_mask: Tensor,
    attn: Tensor,
    anchors: Anchors,
    loss: LossConfig,
    target_logits: Tensor | None,
) -> Tensor:
    """The normalised loss from the papers, slot by slot.

    DFlash: w_k = exp(-(k-1)/gamma). D-PACE (arXiv 2605.18810): per block, over its supervised
    slots j in order, q_j = exp(-CE_j) (detached), q~_j = (1-alpha) q_j + alpha,
    C_j = prod_{i<=j} q~_i, w_j = sum_{m>=j} C_m. KD: H(softmax(target logits at a+k-1),
    softmax(drafter logits)), mixed (1-lambda) CE + lambda KD. Loss = sum w l / sum w."""
    pos = anchors.positions
    block_ids = drafter.block_input_ids(ids.gather(1, pos))
    block_pos = (pos[:, :, None] + torch.arange(BLOCK)).flatten(1)
    hidden = drafter(feats, block_ids, block_pos, build_mask(pos, attn, BLOCK, "sdpa"))
    logits = hidden @ drafter.lm_head.weight.t()  # [R, N*B, V], dense
    seq, lam = ids.shape[1], loss.kd_weight
    alpha = 0.5 if loss.alpha is None else loss.alpha
    total, weight = torch.zeros(()), torch.zeros(())
    for r in range(ids.shape[0]):
        for n in range(pos.shape[1]):
            if not anchors.keep[r, n]:
                continue
            a = int(pos[r, n])
            slots = []  # (k, per-slot loss, CE) of the supervised slots, in order
            for k in range(1, BLOCK):
                if a + k >= seq or not (loss_mask[r, a + k] and attn[r, a + k]):
                    continue
                z = logits[r, n * BLOCK + k]
                ce = -torch.log_softmax(z, -1)[ids[r, a + k]]
                term = ce
                if lam > 0:
                    assert target_logits is not None
                    p = torch.softmax(target_logits[r, a + k - 1], -1)
                    term = (1 - lam) * ce - lam * (p * torch.log_softmax(z, -1)).sum()
                slots.append((k, term, ce))
            if loss.type == "ce":
                ws = [math.exp(-(k - 1) / GAMMA) for k, _, _ in slots]
            else:
                c, cums = 1.0, []
                for _, _, ce in slots:
                    c *= (1 - alpha) * math.exp(-float(ce.detach())) + alpha
                    cums.append(c)
                ws = [sum(cums[j:]) for j in range(len(cums))]
            for w, (_, term, _) in zip(ws, slots, strict=True):
                total = total + w * term
                weight = weight + w
    return total / weight


def _grads(drafter: torch.nn.Module) -> dict[str, Tensor]:
    return {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}


def _assert_grads_close(got: dict[str, Tensor], ref: dict[str, Tensor], rel: float) -> None:
    assert got.keys() == ref.keys() and got
    for name, g in got.items():
        err = float((g - ref[name]).abs().max())
        assert err <= rel * float(ref[name].abs().max()) + 1e-9, (name, err)


LOSSES = [
    LossConfig(type="dpace"),
    LossConfig(type="dpace", alpha=0.2),
    LossConfig(kd_weight=0.3),
    LossConfig(type="dpace", kd_weight=1.0),
]


@pytest.mark.parametrize("loss", LOSSES, ids=lambda x: x.label())
def test_loss_and_gradients_equal_the_papers_formulas(
    target: TargetModel, loss: LossConfig
) -> None:
    """loss_sum / weight_sum and every drafter gradient equal the dense slot-by-slot reference;
    the KD teacher is the captured last hidden state through the chunked head, the reference's
    is HF's own forward logits."""
    ids, loss_mask, attn = make_batch(rows=3, seq=40)
    # unsupervised slots inside blocks (multi-turn chats): a run of 5, and single holes that
    # a block's later supervised slots straddle (no-ops in D-PACE's product)
    loss_mask[2, 20:25] = 0
    loss_mask[0, 12::5] = 0
    loss_mask[1, 14::4] = 0
    captured = target.capture(ids, attn, final=loss.distills)
    width = target.feature_size
    feats, teacher = captured[..., :width], captured[..., width:] if loss.distills else None
    anchors = sample_anchors(loss_mask, attn, 7, torch.Generator().manual_seed(4))
    drafter = make_drafter(target, block_size=BLOCK)
    res = dflash_objective(
        drafter,
        target,
        ids,
        loss_mask,
        attn,
        feats,
        anchors=anchors,
        gamma=GAMMA,
        attn_backend="sdpa",
        loss=loss,
        teacher=teacher,
    )
    got = res.loss_sum / res.weight_sum
    torch.autograd.backward(got)
    grads = _grads(drafter)
    drafter.zero_grad()
    with torch.no_grad():
        hf_logits = target.model(input_ids=ids, attention_mask=attn).logits.float()
    ref = _reference_loss(drafter, feats, ids, loss_mask, attn, anchors, loss, hf_logits)
    torch.autograd.backward(ref)
    assert int(res.n_pred) > 30  # not vacuous
    torch.testing.assert_close(got, ref.detach(), rtol=1e-5, atol=1e-5)
    _assert_grads_close(grads, _grads(drafter), 1e-4)


def test_dpace_weights_by_hand() -> None:
    """One block of 5 slots, slot 3 unsupervised (its CE, whatever it is, is ignored), alpha
    0.5: q~ = (1 + exp(-CE)) / 2, C over the supervised slots, w = suffix sums, 0 at slot 3."""
    ce = torch.tensor([[0.0, math.log(2), 7.0, math.log(4), 1e-9]])
    valid = torch.tensor([[True, True, False, True, True]])
    # q~ = (1 + exp(-CE)) / 2 = 1, 0.75, (slot 3 skipped), 0.625, 1 (to 1e-9)
    c1 = 1.0
    c2 = c1 * 0.75
    c4 = c2 * 0.625
    c5 = c4 * 1.0
    want = [c1 + c2 + c4 + c5, c2 + c4 + c5, 0.0, c4 + c5, c5]
    got = dpace_weights(ce, valid, 0.5)
    torch.testing.assert_close(got, torch.tensor([want]), rtol=1e-6, atol=1e-6)
    assert not got.requires_grad
    with pytest.raises(ValueError, match=r"alpha must be in \(0, 1\]"):
        dpace_weights(ce, valid, 0.0)


def test_the_papers_weights_differ_from_the_decay(target: TargetModel) -> None:
    """The equality above has teeth: on the same slots, D-PACE's normalised loss is not the
    decayed CE's, and neither is the distilled one."""
    ids, loss_mask, attn = make_batch(rows=2, seq=32)
    captured = target.capture(ids, attn, final=True)
    feats, teacher = captured[..., : target.feature_size], captured[..., target.feature_size :]
    anchors = sample_anchors(loss_mask, attn, 5, torch.Generator().manual_seed(1))
    drafter = make_drafter(target, block_size=BLOCK)
    values = []
    for loss in (LossConfig(), LossConfig(type="dpace"), LossConfig(kd_weight=1.0)):
        with torch.no_grad():
            r = dflash_objective(
                drafter, target, ids, loss_mask, attn, feats, anchors=anchors, gamma=GAMMA,
                loss=loss, teacher=teacher,
            )  # fmt: skip
        values.append(float(r.loss_sum / r.weight_sum))
    assert len({round(v, 4) for v in values}) == 3, values


def test_the_captured_last_hidden_state_is_what_the_lm_head_reads(target: TargetModel) -> None:
    """capture(final=True) appends the post-norm last hidden state: through lm_head it gives
    HF's own logits, on padded and on packed rows; the layer features are unchanged."""
    ids, _, attn = make_batch(rows=2, seq=24)
    plain = target.capture(ids, attn)
    both = target.capture(ids, attn, final=True)
    width = target.feature_size
    assert both.shape[-1] == width + target.hidden_size
    torch.testing.assert_close(both[..., :width], plain)
    with torch.no_grad():
        logits = target.model(input_ids=ids, attention_mask=attn).logits
        mine = target.lm_head(both[..., width:])
    real = attn.bool()
    torch.testing.assert_close(mine[real], logits[real], rtol=1e-4, atol=1e-4)
    # packed: two documents in one row, each must equal the document run alone
    pos = torch.cat([torch.arange(10), torch.arange(14)])[None]
    row = torch.cat([ids[0, :10], ids[1, :14]])[None]
    packed = target.capture(row, torch.ones_like(row), position_ids=pos, final=True)
    with torch.no_grad():
        alone = target.model(input_ids=ids[1:2, :14]).logits
        mine = target.lm_head(packed[0, 10:, width:])
    torch.testing.assert_close(mine, alone[0], rtol=1e-4, atol=1e-4)


def test_distillation_without_a_teacher_is_refused(target: TargetModel) -> None:
    ids, loss_mask, attn = make_batch()
    drafter = make_drafter(target, block_size=BLOCK)
    with pytest.raises(ValueError, match="kd_weight > 0 needs the target's last hidden state"):
        dflash_objective(
            drafter, target, ids, loss_mask, attn, target.capture(ids, attn),
            loss=LossConfig(kd_weight=0.5),
        )  # fmt: skip


@pytest.mark.parametrize("budget", [None, 8, 2])
def test_split_steps_keep_dpace_and_distillation_exact(
    target: TargetModel, budget: int | None
) -> None:
    """D-PACE's weights are per block and a piece holds whole blocks, and each piece gathers
    its own teacher rows: every budget gives the one-pass sums and gradients."""
    loss = LossConfig(type="dpace", kd_weight=0.5)
    ids, loss_mask, attn = make_batch(rows=3, seq=40)
    captured = target.capture(ids, attn, final=True)
    feats, teacher = captured[..., : target.feature_size], captured[..., target.feature_size :]

    def step(max_query_rows: int | None) -> tuple[StepResult, dict[str, Tensor]]:
        drafter = make_drafter(target, block_size=BLOCK)
        res = bounded_objective_backward(
            drafter, ids, loss_mask, attn, feats, max_query_rows=max_query_rows,
            num_anchors=8, generator=torch.Generator().manual_seed(2), loss=loss,
            teacher=teacher,
        )  # fmt: skip
        return res, _grads(drafter)

    ref, ref_grads = step(None)
    got, grads = step(budget)
    for f in fields(StepResult):
        a, b = getattr(got, f.name), getattr(ref, f.name)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f.name)
    _assert_grads_close(grads, ref_grads, 1e-5)
