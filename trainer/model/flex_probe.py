"""Does the drafter's flex_attention compile and run, forward and backward, on this device?

One small call at the drafter's real heads, KV heads, head_dim, block size and dtype, with the
analytic BlockMask (`masks.flex_dflash_block_mask`) and the kernel options the training step
uses (`attention.attend`): what the first step would compile, minus the batch. torch.compile
specialises on those, not on the lengths (`dynamic=True`), so a pass here is the kernel the
step gets. `trainer.doctor` runs it as a stage; the trainer runs it before its first step and
falls back to SDPA when it fails (`trainer.pipeline.attention_choice`).
"""

from __future__ import annotations

import traceback
from dataclasses import dataclass

import torch

from trainer.model.attention import attend
from trainer.model.masks import TILE, flex_dflash_block_mask


@dataclass(frozen=True)
class AttentionShape:
    heads: int
    kv_heads: int
    head_dim: int
    block_size: int


@dataclass(frozen=True)
class ProbeFailure:
    """Why flex did not run: the exception's type and first line, and its traceback."""

    kind: str
    message: str
    traceback: str

    def line(self) -> str:
        return f"{self.kind}: {self.message}" if self.message else self.kind


def probe(shape: AttentionShape, device: torch.device, dtype: torch.dtype) -> ProbeFailure | None:
    """Run flex forward + backward once; None when it worked, else what failed."""
    try:
        _run(shape, device, dtype)
    except Exception as exc:  # any failure to compile or run is a verdict, not a crash
        text = str(exc).strip()
        first = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
        return ProbeFailure(type(exc).__name__, first[:300], traceback.format_exc())
    return None


def _run(shape: AttentionShape, device: torch.device, dtype: torch.dtype) -> None:
    blocks = max(1, TILE // shape.block_size)  # one full query tile
    context = 2 * TILE
    gen = torch.Generator().manual_seed(0)

    def rand(heads: int, length: int) -> torch.Tensor:
        t = torch.randn(1, heads, length, shape.head_dim, generator=gen, dtype=torch.float32)
        return t.to(device=device, dtype=dtype).requires_grad_(True)

    q = rand(shape.heads, blocks * shape.block_size)
    k = rand(shape.kv_heads, context + blocks * shape.block_size)
    v = rand(shape.kv_heads, context + blocks * shape.block_size)
    anchors = torch.linspace(1, context - 1, blocks).long().unsqueeze(0).to(device)
    valid = torch.ones(1, context, dtype=torch.bool, device=device)
    mask = flex_dflash_block_mask(anchors, valid, shape.block_size)
    out = attend(q, k, v, mask, scale=shape.head_dim**-0.5)
    torch.autograd.backward(out.float().square().sum())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
