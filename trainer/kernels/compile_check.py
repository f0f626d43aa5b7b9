"""Compile the Triton kernels for CUDA architectures on a machine without a GPU, and check that
every kernel the drafter runs fits the architecture's shared memory per block.

    python -m trainer.kernels.compile_check [--arch 90 100 120] [--dtype bf16 fp32]
                                            [--head-dim 128] [--limit BYTES]

Triton lowers to PTX and runs its bundled ptxas without a driver, so CI on CPU can prove that the
code the GPU will run compiles with the shipped tile configuration, uses tensor cores (wgmma on
sm_90) and is software-pipelined (async global->shared copies), and fits in shared memory. Launch
specialisations are mimicked: 16-byte-aligned pointers, row strides divisible by 16, unit inner
strides. flex_attention's kernels are inductor templates, which need a device to be generated:
for them the line is the tiles `trainer.kernels.flex_options` picks for the architecture at
`--head-dim` (bf16, the training dtype) and that module's shared-memory estimate
(`"measured": false`). The limit is the architecture's `shared_memory_per_block_optin`
(`trainer.kernels.devices`; `--limit` overrides it). Prints one JSON object per kernel and exits
1 if any kernel fails to compile or needs more shared memory than the limit. Must run without
TRITON_INTERPRET=1 (the interpreter replaces the compiler).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # importing triton_ce imports triton, and main checks TRITON_INTERPRET first
    from trainer.kernels.triton_ce import JitFunction

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
ROW_STRIDES = ("stride_hn", "stride_wv", "stride_on", "D")


def compile_kernel(kernel: JitFunction[..., None], dtype_name: str, arch: int) -> dict[str, object]:
    """Compile one kernel with the shipped tiles; report shared memory, tensor cores, pipelining."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from trainer.kernels import triton_ce

    tiles = triton_ce.default_tiles(DTYPES[dtype_name])
    consts: dict[str, object] = {
        "BLOCK_N": tiles.block_n,
        "BLOCK_V": tiles.block_v,
        "BLOCK_D": tiles.block_d,
        "PRECISION": "ieee" if dtype_name == "fp32" else "tf32",
        "stride_hd": 1,
        "stride_wd": 1,
    }
    pointer_types = {
        "h_ptr": dtype_name, "w_ptr": dtype_name, "out_ptr": dtype_name,
        "labels_ptr": "i64", "best_idx_ptr": "i32",
    }  # fmt: skip
    names = kernel.arg_names
    signature = {
        n: "constexpr"
        if n in consts
        else ("*" + pointer_types.get(n, "fp32") if n.endswith("_ptr") else "i32")
        for n in names
    }
    aligned = [n for n in names if n.endswith("_ptr") or n in ROW_STRIDES]
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(kernel, signature, constexprs=consts, attrs=attrs)
    compiled = triton.compile(
        source,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": tiles.num_warps, "num_stages": tiles.num_stages},
    )
    ttgir = compiled.asm["ttgir"]
    return {
        "kernel": kernel.__name__,
        "dtype": dtype_name,
        "arch": arch,
        "shared_bytes": compiled.metadata.shared,
        "tensor_cores": bool(re.search(r"warp_group_dot|nvidia_mma|\bmma\b|tc_gen5_mma", ttgir)),
        "pipelined": "async_copy_global_to_local" in ttgir or "async_tma_copy" in ttgir,
    }


def flex_reports(arch: int, limit: int, head_dim: int) -> list[dict[str, object]]:
    """The flex_attention tiles for `arch` and their estimated shared memory (no compile)."""
    from trainer.kernels.flex_options import DTYPE_BYTES, choose

    o = choose(arch, limit, head_dim, head_dim, DTYPE_BYTES["bf16"])
    common = {"dtype": "bf16", "arch": arch, "head_dim": head_dim, "measured": False}
    return [
        {
            "kernel": "flex_attention_fwd",
            "tiles": str(o.fwd),
            "shared_bytes": o.fwd_bytes,
            **common,
        },
        {
            "kernel": "flex_attention_bwd",
            "tiles": str(o.bwd),
            "shared_bytes": o.bwd_bytes,
            **common,
        },
    ]


def main(argv: list[str] | None = None) -> int:
    from trainer.kernels.devices import SHARED_MEMORY_OPTIN

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--arch",
        type=int,
        nargs="+",
        default=[90],
        choices=sorted(SHARED_MEMORY_OPTIN),
        help="compute capability x10 (90 = H100/H200, 100 = B200, 120 = RTX PRO 6000)",
    )
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    parser.add_argument("--head-dim", type=int, default=128, help="the drafter's (flex tiles)")
    parser.add_argument("--limit", type=int, help="bytes per block (default: the arch's)")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "compile_check: unset TRITON_INTERPRET; the interpreter cannot compile", file=sys.stderr
        )
        return 2
    from trainer.kernels import triton_ce
    from trainer.kernels.flex_options import NoFittingTiles

    failed = False
    for arch in args.arch:
        limit = args.limit if args.limit is not None else SHARED_MEMORY_OPTIN[arch]
        reports: list[dict[str, object]] = []
        for dtype_name in args.dtype:
            for kernel in (triton_ce._forward_kernel, triton_ce._dlogits_kernel):
                try:
                    reports.append(compile_kernel(kernel, dtype_name, arch) | {"measured": True})
                except Exception as exc:  # report every kernel, then fail
                    failed = True
                    msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                    print(
                        f"compile_check: {kernel.__name__} {dtype_name} sm_{arch}: {msg}",
                        file=sys.stderr,
                    )
        try:
            reports.extend(flex_reports(arch, limit, args.head_dim))
        except NoFittingTiles as exc:
            failed = True
            print(f"compile_check: {exc}", file=sys.stderr)
        for rep in reports:
            shared = rep["shared_bytes"]
            assert isinstance(shared, int)
            rep["limit"] = limit
            print(json.dumps(rep), flush=True)
            if shared > limit:
                failed = True
                print(
                    f"compile_check: {rep['kernel']} {rep['dtype']} sm_{arch} needs {shared:,} B "
                    f"of shared memory per block, more than the {limit:,} B allowed",
                    file=sys.stderr,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
