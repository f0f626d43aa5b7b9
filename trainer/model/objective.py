"""The DFlash training objective: one forward over many anchored blocks per sequence.

Per row: sample up to `num_anchors` anchors among supervised positions (`masks.sample_anchors`),
build blocks [x_a, mask, ..., mask] at positions a..a+B-1, run the drafter once with the DFlash
mask, and score slot k (1..B-1) against token a+k — the SAME absolute position, which is where
trainers have shipped off-by-one drafters. Only valid slots (label inside the row and
supervised) are scored; their losses and weights are `[model.loss]`'s (`trainer.model.losses`:
the decayed CE by default, D-PACE, logit distillation). The LM head + CE goes through the fused
kernel on the valid rows only, so the [rows x vocab] logits never exist.

Everything returned is a sum, not a mean: the pipeline adds sums over micro-batches and data-
parallel ranks and divides once by the global weight sum (exact token-weighted mean).

Packed rows (`position_ids`, restarting at 0 at each document): anchors are drawn per document
(`masks.sample_anchors`), a block sees only its own document's earlier context (`context_start`
= the anchor's document start), RoPE runs at document-relative positions (context and block),
and a label past its document's end is invalid. A document then contributes exactly the terms it
contributes alone in a row of its own, so the sums (and the global normalisation) are those of
the unpacked run on the same samples and anchors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import cast

import torch
from torch import Tensor

from trainer.config import LossConfig
from trainer.kernels.common import Backend
from trainer.model.attention import build_mask
from trainer.model.documents import ContextRows
from trainer.model.drafter import DFlashDrafter, default_gamma
from trainer.model.losses import CE, slot_losses, slot_weights, teacher_rows
from trainer.model.masks import Anchors, sample_anchors


@dataclass
class StepResult:
    """Sums for one micro-batch; divide by the global `weight_sum` (loss) or counts (metrics)."""

    loss_sum: Tensor  # differentiable sum of weight * CE
    weight_sum: Tensor  # sum of weights (detached)
    n_correct: Tensor  # valid predictions whose argmax == label (un-decayed)
    n_pred: Tensor  # valid predictions
    streak_sum: Tensor  # per block: leading correct slots under teacher forcing (max B-1)
    n_blocks: Tensor  # blocks with at least one valid prediction
    pos_correct: Tensor  # [B-1] correct per slot k=1..B-1
    pos_count: Tensor  # [B-1] valid per slot

    def metric_tensors(self) -> dict[str, Tensor]:
        """All metric sums (detached), for one all-reduce and one host copy per log interval."""
        return {f.name: getattr(self, f.name).detach() for f in fields(self)}


# The packed draw's name before it joined `masks.sample_anchors` (split_step and tests).
draw_anchors = sample_anchors


def block_labels(
    input_ids: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    anchors: Anchors,
    block_size: int,
    position_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Labels [R, N, B-1] = token a+k and validity (kept block, in range, real, supervised;
    packed rows: and still the anchor's document, i.e. at document position pos(a) + k)."""
    seq = input_ids.shape[1]
    device = input_ids.device
    k = torch.arange(1, block_size, device=device)
    anchor = _to_device(anchors.positions, device)
    pos = anchor[:, :, None] + k  # [R, N, B-1]
    in_range = pos < seq
    safe = pos.clamp(max=seq - 1).flatten(1)
    labels = input_ids.gather(1, safe).view_as(pos)
    supervised = (loss_mask.bool() & attention_mask.bool()).gather(1, safe).view_as(pos)
    valid = in_range & supervised & _to_device(anchors.keep, device)[:, :, None]
    if position_ids is not None:
        doc_pos = position_ids.to(device)
        rel = doc_pos.gather(1, anchor)[:, :, None] + k
        valid &= doc_pos.gather(1, safe).view_as(pos) == rel
    return labels, valid


def streaks(correct: Tensor, valid: Tensor) -> Tensor:
    """Leading correct slots per block; unsupervised slots neither break nor count."""
    passed = correct | ~valid
    leading = torch.cumprod(passed.to(torch.int32), dim=-1).bool()
    return (leading & valid & correct).sum(-1)


def dflash_objective(
    drafter: DFlashDrafter,
    target: object | None,
    input_ids: Tensor,
    loss_mask: Tensor,
    attention_mask: Tensor,
    hidden: Tensor,
    *,
    num_anchors: int = 512,
    gamma: float | None = None,
    noise: float = 0.0,
    generator: torch.Generator | None = None,
    anchors: Anchors | None = None,
    attn_backend: str = "auto",
    ce_backend: Backend = "auto",
    position_ids: Tensor | None = None,
    host_masks: tuple[Tensor, Tensor, Tensor | None] | None = None,
    context_rows: ContextRows | None = None,
    loss: LossConfig = CE,
    teacher: Tensor | None = None,
) -> StepResult:
    """Weighted loss sums and teacher-forced metrics for one micro-batch.

    Args:
        drafter: bound to the target (`bind_target`); its `lm_head` weight is the CE head.
        target: the TargetModel (or None); when given, the drafter must borrow its modules.
        input_ids, loss_mask, attention_mask: [R, S] right-padded rows.
        hidden: [R, S, F*H] captured features for those rows.
        num_anchors: most anchors per row (fewer when the row has fewer eligible positions).
        gamma: slot decay; None = 7/5/4 for block 16/10/8.
        noise: std of Gaussian noise added to `hidden` (0 = clean features).
        generator: CPU generator for anchors and noise (reproducible on any device).
        anchors: explicit anchors (evaluation, tests) instead of sampling.
        attn_backend: "auto" (flex on CUDA), "sdpa" or "flex".
        ce_backend: passed to `trainer.kernels.lm_head_cross_entropy`.
        position_ids: [R, S] document-relative positions of packed rows (None: one document
            per row); see the module docstring.
        host_masks: (loss_mask, attention_mask, position_ids) of the same rows on the host,
            with host `anchors`: which slots are valid is then known on the host and nothing
            is read back from the device (else one read: the valid slots' indices).
        context_rows: the rows are unpacked documents of packed rows and `hidden` is those
            packed rows' features (`trainer.model.documents`): the drafter projects the
            context there and gathers each row's through `context_rows.index`.
        loss: `[model.loss]` (`trainer.model.losses`); `gamma` is read by type "ce" only.
        teacher: [R, S, H] the target's last (post-norm) hidden states of the same rows as
            `input_ids` (needed when `loss.kd_weight` > 0): slot k of anchor a learns the
            target's distribution at a+k-1.
    """
    cfg = drafter.config
    bsz = cfg.block_size
    if target is not None and getattr(target, "lm_head", None) is not drafter.lm_head:
        raise ValueError("drafter is bound to a different target than the one passed")
    device = hidden.device
    gamma = default_gamma(bsz) if gamma is None else float(gamma)
    if gamma <= 0 or math.isnan(gamma):
        raise ValueError(f"gamma must be positive, got {gamma}")
    if anchors is None:
        anchors = sample_anchors(loss_mask, attention_mask, num_anchors, generator, position_ids)
    if anchors.num_blocks == 0:
        return _empty_result(drafter, bsz, device)

    if noise > 0:
        hidden = hidden + _noise_like(hidden, noise, generator)
    host_anchors = anchors
    anchors = Anchors(_to_device(anchors.positions, device), _to_device(anchors.keep, device))
    positions = anchors.positions
    anchor_ids = input_ids.gather(1, positions)
    block_ids = drafter.block_input_ids(anchor_ids)
    context_pos, context_start, first = None, None, positions
    if position_ids is not None:  # packed: document-relative RoPE, own-document context
        context_pos = position_ids.to(device)
        first = context_pos.gather(1, positions)  # the anchor's position in its document
        context_start = positions - first
    block_pos = (first[:, :, None] + torch.arange(bsz, device=device)).flatten(1)
    if context_rows is None:
        mask = build_mask(positions, attention_mask.to(device), bsz, attn_backend, context_start)
    else:  # one mask per attention group, over the group's context width
        valid_ctx = attention_mask.to(device)
        mask = tuple(
            build_mask(positions[rows], valid_ctx[rows, :width], bsz, attn_backend)
            for rows, width in context_rows.spans()
        )
    out = drafter(  # [R, N*B, H]
        hidden, block_ids, block_pos, mask, context_positions=context_pos, context_rows=context_rows
    )

    labels, valid = block_labels(input_ids, loss_mask, attention_mask, anchors, bsz, position_ids)
    # The valid slots by index, in the order boolean-mask indexing takes them (row-major):
    # `x[valid]` reads the mask back to size its result (a sync, and one more in backward).
    host_valid = None
    if host_masks is not None and host_anchors.positions.device.type == "cpu":
        h_loss, h_attn, h_pos = host_masks  # labels unused: the loss mask stands in for ids
        host_valid = block_labels(h_loss, h_loss, h_attn, host_anchors, bsz, h_pos)[1]
    flat = valid.flatten()
    if host_valid is None:
        idx = flat.nonzero().squeeze(1)
    else:
        idx = _to_device(host_valid.flatten().nonzero().squeeze(1), device)
    rows = idx + idx // (bsz - 1) + 1  # slot k of block (r, n) is row (r*N + n)*B + k of out
    head = drafter.lm_head.weight
    hidden_sel = out.reshape(-1, out.shape[-1]).index_select(0, rows)
    teacher_sel = None
    if loss.distills:
        if teacher is None:
            raise ValueError("kd_weight > 0 needs the target's last hidden state (teacher)")
        at = teacher_rows(positions, input_ids.shape[1], idx, bsz)
        teacher_sel = teacher.reshape(-1, teacher.shape[-1]).index_select(0, at.to(teacher.device))
    scored = slot_losses(
        hidden_sel.to(head.dtype),
        head,
        labels.flatten().index_select(0, idx),
        loss=loss,
        block_weights=slot_weights(bsz, gamma, device).index_select(0, idx % (bsz - 1)),
        blocks=(idx, valid),
        teacher=None if teacher_sel is None else teacher_sel.to(device),
        ce_backend=ce_backend,
    )
    correct = torch.zeros_like(flat).scatter(0, idx, scored.correct).view_as(valid)
    block_streak = streaks(correct, valid)  # 0 for a block without a valid slot
    has_pred = valid.any(-1)
    return StepResult(
        loss_sum=(scored.loss * scored.weight).sum(),
        weight_sum=scored.weight.sum(),
        n_correct=scored.correct.sum(),
        n_pred=valid.sum(),
        streak_sum=block_streak.sum(),
        n_blocks=has_pred.sum(),
        pos_correct=correct.sum((0, 1)),
        pos_count=valid.sum((0, 1)),
    )


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """A host tensor (the anchors, drawn on the CPU) onto `device` without blocking the host:
    on CUDA through pinned memory with a non-blocking copy (a pageable one waits for the copy;
    the caching host allocator keeps the pinned block until the copy has read it)."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def _noise_like(hidden: Tensor, std: float, generator: torch.Generator | None) -> Tensor:
    """Gaussian noise drawn from the CPU generator's stream, identical on every device."""
    if hidden.device.type == "cpu":
        return torch.randn(hidden.shape, generator=generator, dtype=hidden.dtype) * std
    seed = int(torch.randint(0, 2**62, (1,), generator=generator))
    dev_gen = torch.Generator(device=hidden.device).manual_seed(seed)
    return (
        torch.randn(hidden.shape, generator=dev_gen, device=hidden.device, dtype=hidden.dtype) * std
    )


def _empty_result(drafter: DFlashDrafter, bsz: int, device: torch.device) -> StepResult:
    """No eligible anchor in the batch: zero sums that still backprop (DDP needs a graph)."""
    zero = cast(Tensor, sum(p.sum() for p in drafter.parameters())) * 0.0  # >= 1 parameter
    z = torch.zeros((), dtype=torch.float32, device=device)
    zi = torch.zeros((), dtype=torch.long, device=device)
    zk = torch.zeros(bsz - 1, dtype=torch.long, device=device)
    return StepResult(zero, z, zi, zi, zi, zi, zk, zk.clone())
