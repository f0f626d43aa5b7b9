"""Build cost of the drafter's flex BlockMask: analytic (the training path) vs create_block_mask.

`trainer.model.masks.flex_dflash_block_mask` computes the tile structure from the anchors;
`reference_flex_block_mask` is create_block_mask over the same mask_mod, uncompiled (the path
before issue 16 item 5), which evaluates the mask_mod on every (q, kv) element. For each shape:
median wall time over a few builds and the peak of live CPU tensor bytes during one build
(`trainer.kernels.peak_memory.cpu_peak_bytes`), next to the bytes of one dense bool [R, Q, KV]
mask. Both builds are checked equal (to_dense) where the reference runs.

Then the seed's real shapes (configs/qwen3-8b-6x1.toml: buckets up to 768 ... 8192 positions,
token budget 49,152, at most 64 rows, 512 anchors, block 16): the analytic build runs at full
size; the reference is measured at one row and scaled by the row count (its cost is linear in
rows), for a whole packet and for one micro-step at max_query_rows = 24,576.

    .venv/bin/python benchmarks/bench_mask.py            # CPU; add --device cuda on a GPU

CPU figures use one thread by default (--threads): on a shared host more threads only add
contention noise.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor

from trainer.kernels.peak_memory import cpu_peak_bytes, cuda_peak_bytes
from trainer.model.masks import flex_dflash_block_mask, reference_flex_block_mask

BLOCK = 16
# (rows, context length, anchors per row)
GRID = [(1, 512, 64), (4, 512, 128), (2, 2048, 256), (8, 768, 512), (1, 8192, 512)]
SEED_BUCKETS = [768, 1215, 1727, 2431, 3295, 8192]  # longest sequence of each bucket
TOKEN_BUDGET, MAX_BATCH, ANCHORS, MAX_QUERY_ROWS = 49152, 64, 512, 24576


def inputs(rows: int, seq: int, n: int, device: str) -> tuple[Tensor, Tensor, Tensor]:
    """Sorted distinct anchors per row, a ragged valid mask, two documents per row."""
    g = torch.Generator().manual_seed(rows * 7919 + seq)
    n = min(n, seq - 1)
    anchors = torch.stack(
        [torch.randperm(seq - 1, generator=g)[:n].sort().values for _ in range(rows)]
    )
    valid = torch.ones(rows, seq, dtype=torch.bool)
    valid[rows // 2 :, seq - seq // 8 :] = False  # some rows shorter (padding)
    start = torch.where(anchors >= seq // 2, seq // 2, 0)  # packed: a second document at S/2
    return anchors.to(device), valid.to(device), start.to(device)


def cost(fn: Callable[[], object], device: str, reps: int) -> tuple[float, int]:
    """(median ms, peak bytes of one call)."""
    peak = cuda_peak_bytes(fn) if device == "cuda" else cpu_peak_bytes(fn)
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return (statistics.median(times) if times else float("nan")), peak


def mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def grid(device: str) -> None:
    print(
        f"{'R':>3} {'S':>5} {'N':>4} {'Q':>5} {'KV':>6} {'dense mask':>12} | "
        f"{'analytic ms':>11} {'peak':>11} | {'create_block_mask ms':>20} {'peak':>12}"
    )
    for rows, seq, n in GRID:
        a, v, c = inputs(rows, seq, n, device)
        n = a.shape[1]
        q, kv = n * BLOCK, seq + n * BLOCK
        fast_ms, fast_peak = cost(partial(flex_dflash_block_mask, a, v, BLOCK, c), device, 5)
        ref_ms, ref_peak = cost(partial(reference_flex_block_mask, a, v, BLOCK, c), device, 3)
        got = flex_dflash_block_mask(a, v, BLOCK, c).to_dense()
        assert torch.equal(got, reference_flex_block_mask(a, v, BLOCK, c).to_dense())
        print(
            f"{rows:>3} {seq:>5} {n:>4} {q:>5} {kv:>6} {mib(rows * q * kv):>12} | "
            f"{fast_ms:>11.2f} {mib(fast_peak):>11} | {ref_ms:>20.1f} {mib(ref_peak):>12}",
            flush=True,
        )


def seed(device: str) -> None:
    print(f"\nseed shapes (block {BLOCK}, {ANCHORS} anchors; reference measured at 1 row x rows)")
    print(
        f"{'S':>5} {'R':>3} {'piece R':>7} | {'analytic ms':>11} {'peak':>10} | "
        f"{'dense [R,Q,KV]':>14} {'create_block_mask peak':>22} | {'per micro-step':>14}"
    )
    for seq in SEED_BUCKETS:
        rows = min(MAX_BATCH, TOKEN_BUDGET // seq)
        piece_rows = max(1, MAX_QUERY_ROWS // (ANCHORS * BLOCK))
        a, v, c = inputs(rows, seq, ANCHORS, device)
        n = a.shape[1]
        q, kv = n * BLOCK, seq + n * BLOCK
        fast_ms, fast_peak = cost(partial(flex_dflash_block_mask, a, v, BLOCK, c), device, 3)
        a1, v1, c1 = a[:1], v[:1], c[:1]
        _, ref_peak_1 = cost(partial(reference_flex_block_mask, a1, v1, BLOCK, c1), device, 0)
        print(
            f"{seq:>5} {rows:>3} {piece_rows:>7} | {fast_ms:>11.1f} {mib(fast_peak):>10} | "
            f"{mib(rows * q * kv):>14} {mib(rows * ref_peak_1):>22} | "
            f"{mib(piece_rows * ref_peak_1):>14}",
            flush=True,
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--skip-grid", action="store_true")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (shared hosts: 1)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if not args.skip_grid:
        grid(args.device)
    seed(args.device)


if __name__ == "__main__":
    main()
