"""Drafter training step on CPU: one masked pass over all anchors vs one pass per anchor.

    .venv/bin/python benchmarks/bench_drafter.py

Why the objective runs every block of a sequence in ONE forward with the DFlash mask instead
of one forward per anchor (what inference does): same numbers (tests/model/test_objective.py
checks equality), far fewer kernel launches and no re-projection of the context per anchor.
Side by side in one run: forward+backward time per sequence for the one-pass objective and
for a per-anchor loop, at several anchor counts (the loop only where it finishes in seconds). Target: random Qwen3, H=256, 8 layers,
vocab 4096; drafter: 2 layers, block 16; 2 rows of 512 tokens (448 supervised).
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.kernels import lm_head_cross_entropy
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.masks import Anchors, sample_anchors
from trainer.model.objective import block_labels, dflash_objective
from trainer.model.target import TargetModel
from trainer.model.tiny import build_tiny_target

ROWS, SEQ, BLOCK = 2, 512, 16


def timed(fn: Callable[[], object], reps: int = 3) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - start) / reps


def main() -> int:
    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        path = build_tiny_target(Path(tmp) / "t", vocab_size=4096, hidden_size=256)
        target = TargetModel.load(path, [1, 5])
    torch.manual_seed(0)
    cfg = DrafterConfig.from_target(target, mask_token_id=4095, num_layers=2, block_size=BLOCK)
    drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
    ids = torch.randint(0, 4000, (ROWS, SEQ), generator=torch.Generator().manual_seed(0))
    loss = torch.ones_like(ids)
    loss[:, :64] = 0
    attn = torch.ones_like(ids)
    feats = target.capture(ids, attn)
    print(f"{'anchors/row':>11} {'one-pass ms':>12} {'per-anchor ms':>14} {'speedup':>8}")
    for n in (8, 32, 128):
        anchors = sample_anchors(loss, attn, n, torch.Generator().manual_seed(1))

        def one_pass(anchors: Anchors = anchors) -> None:
            drafter.zero_grad(set_to_none=True)
            res = dflash_objective(
                drafter, target, ids, loss, attn, feats, anchors=anchors, attn_backend="sdpa"
            )
            torch.autograd.backward(res.loss_sum)

        def per_anchor(anchors: Anchors = anchors) -> None:
            drafter.zero_grad(set_to_none=True)
            labels, valid = block_labels(ids, loss, attn, anchors, BLOCK)
            total = torch.zeros(())
            for r in range(ROWS):
                for j in range(anchors.num_blocks):
                    a = int(anchors.positions[r, j])
                    block = drafter.block_input_ids(ids[r : r + 1, a : a + 1])
                    out = drafter(feats[r : r + 1, :a], block, torch.arange(a, a + BLOCK)[None])
                    keep = valid[r, j]
                    ce = lm_head_cross_entropy(
                        out[0, 1:][keep], target.lm_head.weight, labels[r, j][keep]
                    )
                    total = total + ce.loss.sum()
            torch.autograd.backward(total)

        t_one = timed(one_pass)
        if n > 32:  # the loop grows linearly; skip it where it alone would take minutes
            print(f"{n:>11} {t_one * 1e3:>12.1f} {'-':>14} {'-':>8}")
            continue
        t_loop = timed(per_anchor, reps=1)
        print(f"{n:>11} {t_one * 1e3:>12.1f} {t_loop * 1e3:>14.1f} {t_loop / t_one:>7.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
