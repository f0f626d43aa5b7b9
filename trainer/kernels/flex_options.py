"""flex_attention kernel options that fit the device: tiles, stages and warps from its shared
memory per block and compute capability.

    python -m trainer.kernels.flex_options [--head-dim 128] [--dtype bf16] [--markdown]

Inductor picks flex_attention's tiles from a per-architecture table and learns only when Triton
compiles whether they fit; on sm_120 (101,376 B per block) the backward has failed with "No valid
triton configs" (pytorch#198224, unsloth-zoo#542). Here the options are chosen up front: the
first candidate of the architecture's list (fastest first) whose estimated shared memory fits the
device's `shared_memory_per_block_optin`, passed to flex_attention as `kernel_options`.

The estimate (no device can compile inductor's templates here, so it is a formula, checked in
tests/kernels against every measured "Required" figure we have, with their sources):
  * inductor's gemm-template formula (`get_shared_memory_estimation`: the tiles one pipeline
    stage loads x num_stages) applied to the attention loops: the forward loads a K and a V
    tile [BLOCK_N, D] per stage; the backward loads Q and dO [BLOCK_M1, D] per stage in its
    dK/dV loop and K and V [BLOCK_N2, D] in its dQ loop (the larger counts);
  * one stage is priced as two: a 1-stage backward measured 114,688 B where its loads are 65,536;
  * plus 10 KiB that Triton adds (measured: 140,800 B against 131,072 of loads, unsloth-zoo
    temporary_patches/flex_attention_bwd.py);
  * head dims rounded up to a power of two, as inductor stages them (`set_head_dim_values`).
Torch-free: the choice and its table run from captured device properties.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass

from trainer.kernels.devices import SHARED_MEMORY_OPTIN

TRITON_OVERHEAD = 10 * 1024
SPARSE_TILE = 128  # trainer.model.masks.TILE: every block size must divide it
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class FwdTiles:
    block_m: int
    block_n: int
    stages: int
    warps: int

    def __str__(self) -> str:
        return f"M{self.block_m} N{self.block_n} s{self.stages} w{self.warps}"


@dataclass(frozen=True)
class BwdTiles:
    block_m1: int
    block_n1: int
    block_m2: int
    block_n2: int
    stages: int
    warps: int

    def __str__(self) -> str:
        return (
            f"M1 {self.block_m1} N1 {self.block_n1} M2 {self.block_m2} N2 {self.block_n2} "
            f"s{self.stages} w{self.warps}"
        )


# Fastest first. sm_90/sm_100 (wgmma, tcgen05) run big tiles with 8 warps; the mma.sync
# architectures (sm_8x, sm_12x) keep 4 warps in the backward (register pressure) and step down
# through 32-wide tiles, the fastest that fit at head_dim 256 on sm_12x (pytorch#198228).
WGMMA_FWD = (
    FwdTiles(128, 64, 3, 8),
    FwdTiles(128, 64, 2, 8),
    FwdTiles(64, 64, 3, 4),
    FwdTiles(64, 64, 2, 4),
    FwdTiles(64, 32, 2, 4),
    FwdTiles(64, 16, 2, 4),
    FwdTiles(32, 16, 1, 4),
)
WGMMA_BWD = (
    BwdTiles(64, 128, 128, 64, 3, 8),
    BwdTiles(64, 64, 64, 64, 3, 4),
    BwdTiles(64, 64, 64, 64, 2, 4),
    BwdTiles(32, 32, 32, 32, 2, 4),
    BwdTiles(16, 16, 16, 16, 1, 4),
)
MMA_FWD = (
    FwdTiles(128, 64, 3, 8),
    FwdTiles(128, 64, 2, 8),
    FwdTiles(128, 32, 2, 8),
    FwdTiles(64, 32, 2, 4),
    FwdTiles(64, 16, 2, 4),
    FwdTiles(32, 16, 1, 4),
)
MMA_BWD = (
    BwdTiles(64, 64, 64, 64, 3, 4),
    BwdTiles(64, 64, 64, 64, 2, 4),
    BwdTiles(32, 32, 32, 32, 2, 4),
    BwdTiles(16, 16, 16, 16, 1, 4),
)


def uses_wgmma(arch: int) -> bool:
    """sm_90 and sm_10x: warpgroup tensor-core instructions; sm_8x and sm_12x: mma.sync."""
    return 90 <= arch < 110


def rounded(head_dim: int) -> int:
    return 1 << max(0, math.ceil(math.log2(head_dim)))


def _priced_stages(stages: int) -> int:
    return max(stages, 2)


def fwd_shared_bytes(t: FwdTiles, qk_dim: int, v_dim: int, dtype_bytes: int) -> int:
    loads = t.block_n * (rounded(qk_dim) + rounded(v_dim)) * dtype_bytes
    return _priced_stages(t.stages) * loads + TRITON_OVERHEAD


def bwd_shared_bytes(t: BwdTiles, qk_dim: int, v_dim: int, dtype_bytes: int) -> int:
    per_row = (rounded(qk_dim) + rounded(v_dim)) * dtype_bytes
    loads = max(t.block_m1, t.block_n2) * per_row
    return _priced_stages(t.stages) * loads + TRITON_OVERHEAD


@dataclass(frozen=True)
class FlexOptions:
    """The chosen tiles, their estimated shared memory and the limit they were chosen under."""

    arch: int
    limit: int
    fwd: FwdTiles
    bwd: BwdTiles
    fwd_bytes: int
    bwd_bytes: int

    def kernel_options(self) -> dict[str, int]:
        """flex_attention's `kernel_options`: fwd_/bwd_ prefixes apply to one pass only."""
        f, b = self.fwd, self.bwd
        return {
            "fwd_BLOCK_M": f.block_m,
            "fwd_BLOCK_N": f.block_n,
            "fwd_num_stages": f.stages,
            "fwd_num_warps": f.warps,
            "bwd_BLOCK_M1": b.block_m1,
            "bwd_BLOCK_N1": b.block_n1,
            "bwd_BLOCK_M2": b.block_m2,
            "bwd_BLOCK_N2": b.block_n2,
            "bwd_num_stages": b.stages,
            "bwd_num_warps": b.warps,
        }

    def describe(self) -> str:
        return (
            f"sm_{self.arch}: forward {self.fwd} (~{self.fwd_bytes:,} B), backward {self.bwd} "
            f"(~{self.bwd_bytes:,} B) of {self.limit:,} B per block"
        )


class NoFittingTiles(ValueError):
    """Not even the smallest candidate fits (a device or head dim this table never met)."""


def choose(arch: int, limit: int, qk_dim: int, v_dim: int, dtype_bytes: int) -> FlexOptions:
    """The first forward and backward candidate for `arch` whose estimate fits `limit` bytes."""
    fwd_list, bwd_list = (WGMMA_FWD, WGMMA_BWD) if uses_wgmma(arch) else (MMA_FWD, MMA_BWD)
    fwd = next(
        (t for t in fwd_list if fwd_shared_bytes(t, qk_dim, v_dim, dtype_bytes) <= limit), None
    )
    bwd = next(
        (t for t in bwd_list if bwd_shared_bytes(t, qk_dim, v_dim, dtype_bytes) <= limit), None
    )
    if fwd is None or bwd is None:
        raise NoFittingTiles(
            f"no flex_attention tiles fit sm_{arch}'s {limit:,} B per block at head_dim "
            f"{qk_dim}/{v_dim}, {dtype_bytes}-byte elements"
        )
    return FlexOptions(
        arch,
        limit,
        fwd,
        bwd,
        fwd_shared_bytes(fwd, qk_dim, v_dim, dtype_bytes),
        bwd_shared_bytes(bwd, qk_dim, v_dim, dtype_bytes),
    )


def markdown_table(head_dims: tuple[int, ...] = (64, 128, 256), dtype: str = "bf16") -> str:
    """The choice per architecture of `SHARED_MEMORY_OPTIN` (docs/kernels.md embeds it)."""
    lines = [
        "| arch | limit (B) | head_dim | forward | est. (B) | backward | est. (B) |",
        "|---|---:|---:|---|---:|---|---:|",
    ]
    for arch, limit in sorted(SHARED_MEMORY_OPTIN.items()):
        for d in head_dims:
            o = choose(arch, limit, d, d, DTYPE_BYTES[dtype])
            lines.append(
                f"| sm_{arch} | {limit:,} | {d} | {o.fwd} | {o.fwd_bytes:,} | {o.bwd} | "
                f"{o.bwd_bytes:,} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.kernels.flex_options", description=__doc__)
    ap.add_argument("--arch", type=int, nargs="+", default=sorted(SHARED_MEMORY_OPTIN))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default="bf16")
    ap.add_argument("--markdown", action="store_true", help="the docs table (head_dim 64/128/256)")
    args = ap.parse_args(argv)
    if args.markdown:
        print(markdown_table(dtype=args.dtype))
        return 0
    for arch in args.arch:
        if arch not in SHARED_MEMORY_OPTIN:
            print(f"flex_options: no shared-memory limit recorded for sm_{arch}", file=sys.stderr)
            return 2
        limit = SHARED_MEMORY_OPTIN[arch]
        print(choose(arch, limit, args.head_dim, args.head_dim, DTYPE_BYTES[args.dtype]).describe())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
