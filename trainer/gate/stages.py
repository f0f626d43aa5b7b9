"""The gate's checks, one per stage a drafter passes through before it accepts in serving.

capture  the target's captured features equal transformers' own hidden states at the layer ids
         (HF `hidden_states[i + 1]` = the output of layer i, the convention exports carry);
masks    the training forward (every anchor at once, under the training mask) equals the
         decoding forward (one block after its committed context) at every anchor, before any
         training; and after training, the memorised sample decodes at >= 0.9 x block size;
train    the drafter memorises the sample (teacher-forced accuracy 1 for `patience` steps);
export   the export carries every key an engine reads with the run's value, and the reloaded
         export decodes exactly as the drafter in memory;
engine   the serving engine, on that export, accepts as the project's loop does.
Each raises `GateFailure(stage, detail)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.gate.report import GateFailure
from trainer.model.attention import build_mask
from trainer.model.drafter import DFlashDrafter
from trainer.model.fit import Row, pad_rows
from trainer.model.masks import Anchors
from trainer.model.speculative import SpecOutput, speculative_generate
from trainer.model.target import TargetModel

CAPTURE_ATOL = 1e-4  # fp32 features of the same forward: identical up to summation order
MASK_ATOL = 1e-4  # normed drafter outputs (~unit scale) of two forwards of the same blocks


@dataclass(frozen=True)
class Decoded:
    """The project's loop on each sample's prompt: outputs and the pooled tau."""

    outputs: list[SpecOutput]

    @property
    def accept_lengths(self) -> list[int]:
        return [n for out in self.outputs for n in out.accept_lengths]

    @property
    def tau(self) -> float:
        lengths = self.accept_lengths
        return sum(lengths) / len(lengths) if lengths else 0.0


@torch.no_grad()
def check_capture(target: TargetModel, ids: Tensor) -> float:
    """Max |captured - transformers' hidden_states[i + 1]| over the capture layers."""
    reference = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    captured = target.capture(ids, torch.ones_like(ids))
    width = target.hidden_size
    worst = 0.0
    for k, layer in enumerate(target.layer_ids):
        if layer == target.num_layers - 1:
            continue  # transformers' last hidden state is after the final norm; engines' is not
        diff = (captured[..., k * width : (k + 1) * width] - reference[layer + 1]).abs().max()
        worst = max(worst, float(diff))
    if worst > CAPTURE_ATOL:
        raise GateFailure(
            "capture",
            f"captured features differ from transformers' hidden_states[i + 1] at layer ids "
            f"{target.layer_ids} by up to {worst:.3g} (> {CAPTURE_ATOL:g}): the drafter would "
            "train on other layers than an engine feeds it",
        )
    return worst


@torch.no_grad()
def check_masks(drafter: DFlashDrafter, target: TargetModel, row: Row) -> tuple[float, int]:
    """Max |training forward - decoding forward| over every anchor with a full block in `row`
    (context >= 1 token): the training mask must show each block exactly what decoding shows
    it, its committed context and its own block. Returns (max difference, anchors)."""
    bsz = drafter.config.block_size
    ids, _, attn = pad_rows([row], target.device)
    feats = target.capture(ids, attn)
    anchors = torch.arange(1, ids.shape[1] - bsz + 1, device=ids.device)[None]
    if anchors.numel() == 0:
        raise GateFailure("masks", f"the sample has {ids.shape[1]} tokens: no full block to check")
    positions = Anchors(anchors, torch.ones_like(anchors, dtype=torch.bool)).positions
    block_ids = drafter.block_input_ids(ids.gather(1, positions))
    block_pos = (positions[:, :, None] + torch.arange(bsz, device=ids.device)).flatten(1)
    mask = build_mask(positions, attn, bsz, "sdpa")
    trained = drafter(feats, block_ids, block_pos, mask).view(anchors.shape[1], bsz, -1)
    worst = 0.0
    for n, a in enumerate(anchors[0].tolist()):
        block = block_ids.view(anchors.shape[1], bsz)[n][None]
        decoded = drafter(feats[:, :a], block, (a + torch.arange(bsz, device=ids.device))[None])
        worst = max(worst, float((decoded[0] - trained[n]).abs().max()))
    if worst > MASK_ATOL:
        raise GateFailure(
            "masks",
            f"the training forward differs from the decoding forward by up to {worst:.3g} "
            f"(> {MASK_ATOL:g}) over {anchors.shape[1]} anchors: the training mask shows a "
            "block other context than decoding does",
        )
    return worst, int(anchors.shape[1])


@torch.no_grad()
def decode(target: TargetModel, drafter: DFlashDrafter, rows: Sequence[Row]) -> Decoded:
    """The project's speculative loop on each sample's prompt, for its response's length."""
    outputs = []
    for row in rows:
        prompt = [t for t, m in zip(row.ids, row.loss_mask, strict=True) if not m]  # leading 0s
        outputs.append(speculative_generate(target, drafter, prompt, len(row.ids) - len(prompt)))
    return Decoded(outputs)
