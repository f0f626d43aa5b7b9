"""Drafter acceptance (tau) on the tiny CPU target, measured with the real speculative loop.

    .venv/bin/python benchmarks/bench_tau.py [--rows 1024] [--steps 150] [--held 16]

Side by side in one run, on held-out prompts whose continuations the target generates
greedily: an untrained drafter, drafters trained on the target's own greedy text (block 8
and block 16). For each: the real tau; the teacher-forced streaks of the training forward
walked the way serving advances ("walk", should equal tau); and 1 + the mean streak over all
anchors ("1+streak", what a training log shows; it averages every position, while serving
only visits the positions right after each rejection, so it is not tau).
Every speculative output is checked against greedy decoding. CPU, one thread.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch

from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.fit import (
    Row,
    evaluate_full_blocks,
    fit,
    greedy_continuations,
    teacher_forced_streaks,
    walk_accept_lengths,
)
from trainer.model.speculative import speculative_generate
from trainer.model.target import TargetModel
from trainer.model.tiny import build_tiny_target

PROMPT, NEW, MASK_ID = 8, 40, 511


def measure(
    target: TargetModel, drafter: DFlashDrafter, held: list[Row]
) -> tuple[float, float, float, bool]:
    """(real tau, teacher-forced walk tau, 1 + mean streak over all anchors, outputs == greedy)."""
    taus, walks, same = [], [], True
    for r in held:
        spec = speculative_generate(target, drafter, r.ids[:PROMPT], NEW)
        same &= spec.tokens == r.ids[PROMPT : PROMPT + NEW]
        taus.append(spec.tau)
        walk = walk_accept_lengths(teacher_forced_streaks(drafter, target, r), PROMPT, NEW)
        walks.append(sum(walk) / len(walk))
    sim = 1.0 + evaluate_full_blocks(drafter, target, held).streak
    return sum(taus) / len(taus), sum(walks) / len(walks), sim, same


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=1024, help="training sequences")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--held", type=int, default=16, help="held-out prompts")
    args = p.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        target = TargetModel.load(build_tiny_target(Path(tmp) / "tiny"), [1, 5])
        gen = torch.Generator().manual_seed(0)
        t0 = time.perf_counter()
        rows = greedy_continuations(
            target, torch.randint(0, 500, (args.rows, PROMPT), generator=gen), NEW
        )
        held = greedy_continuations(
            # 16 extra tokens: the walk needs labels wherever a block-16 draft reaches.
            target,
            torch.randint(0, 500, (args.held, PROMPT), generator=gen),
            NEW + 16,
        )
        print(
            f"data: {args.rows} train / {args.held} held-out rows of {PROMPT}+{NEW} tokens "
            f"({time.perf_counter() - t0:.1f}s)"
        )
        print(
            f"{'drafter':<28} {'tau':>6} {'walk':>6} {'1+streak':>9} {'==greedy':>9} {'train s':>8}"
        )
        for block in (8, 16):
            torch.manual_seed(0)
            cfg = DrafterConfig.from_target(
                target, mask_token_id=MASK_ID, num_layers=2, block_size=block, initializer_range=0.1
            )
            drafter = DFlashDrafter(cfg, target.embed_tokens, target.lm_head)
            if block == 8:
                tau, walk, sim, same = measure(target, drafter, held)
                print(
                    f"{'untrained, block 8':<28} {tau:6.2f} {walk:6.2f} {sim:9.2f} {same!s:>9} {0.0:8.1f}"
                )
            t0 = time.perf_counter()
            fit(drafter, target, rows, steps=args.steps, lr=1e-2, batch_size=16, num_anchors=8)
            secs = time.perf_counter() - t0
            tau, walk, sim, same = measure(target, drafter, held)
            name = f"trained, block {block}"
            print(f"{name:<28} {tau:6.2f} {walk:6.2f} {sim:9.2f} {same!s:>9} {secs:8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
