"""Measured peak of one drafter forward+backward on CPU, for validating `costs.activation_peak`.

Builds a drafter at the given shape with random borrowed embedding/LM head, runs one step first
(so the weight grads exist and are not counted), then measures the next step's peak live tensor
bytes with `trainer.kernels.peak_memory.cpu_peak_bytes` (the allocator's own events).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from trainer.kernels.peak_memory import cpu_peak_bytes
from trainer.memory.costs import Piece
from trainer.memory.shapes import DrafterShape
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.masks import Anchors
from trainer.model.objective import dflash_objective
from trainer.model.target import default_target_layer_ids


def drafter_config(d: DrafterShape, num_target_layers: int | None = None) -> DrafterConfig:
    """The DrafterConfig at shape `d`, mask token the last id.

    With `num_target_layers`, the capture layers are DFlash's default for a target that deep;
    without, layers 0..features-1 of a target 3 layers deeper (which layers does not change a
    step's memory).
    """
    if num_target_layers is None:
        layer_ids, num_target_layers = list(range(d.features)), d.features + 3
    else:
        layer_ids = default_target_layer_ids(num_target_layers, d.features)
    return DrafterConfig(
        hidden_size=d.hidden,
        intermediate_size=d.intermediate,
        num_layers=d.layers,
        num_attention_heads=d.heads,
        num_key_value_heads=d.kv_heads,
        head_dim=d.head_dim,
        vocab_size=d.vocab,
        block_size=d.block,
        mask_token_id=d.vocab - 1,
        target_layer_ids=layer_ids,
        num_target_layers=num_target_layers,
    )


def measured_peak(d: DrafterShape, piece: Piece, *, bf16: bool, seed: int = 0) -> int:
    """Peak bytes above the model state of one step at `piece`'s shape (SDPA, chunked CE)."""
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    cfg = drafter_config(d)
    dtype = torch.bfloat16 if bf16 else torch.float32
    emb = nn.Embedding(d.vocab, d.hidden, dtype=dtype).requires_grad_(False)
    head = nn.Linear(d.hidden, d.vocab, bias=False, dtype=dtype).requires_grad_(False)
    drafter = DFlashDrafter(cfg, emb, head)
    rows, seq, width = piece.rows, piece.seq, piece.width
    ids = torch.randint(0, d.vocab - 1, (rows, seq), generator=g)
    ones = torch.ones_like(ids)
    pos = torch.stack([torch.randperm(seq - 1, generator=g)[:width].sort().values for _ in ids])
    anchors = Anchors(pos, torch.ones(rows, width, dtype=torch.bool))
    hidden = torch.randn(rows, seq, d.features * d.hidden, generator=g).to(dtype)
    ctx = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()

    def step() -> None:
        with ctx:
            res = dflash_objective(
                drafter,
                None,
                ids,
                ones,
                ones,
                hidden,
                anchors=anchors,
                attn_backend="sdpa",
                ce_backend="chunked",
            )
        torch.autograd.backward(res.loss_sum.float())

    step()
    return cpu_peak_bytes(step)
