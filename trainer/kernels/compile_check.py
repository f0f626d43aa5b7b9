"""Compile the Triton kernels for a CUDA architecture on a machine without a GPU.

    python -m trainer.kernels.compile_check [--arch 90] [--dtype bf16 fp32]

Triton lowers to PTX and runs its bundled ptxas without a driver, so CI on CPU can prove that the
code the GPU will run compiles with the shipped tile configuration, uses tensor cores (wgmma on
sm_90) and is software-pipelined (async global->shared copies), and fits in shared memory. Launch
specialisations are mimicked: 16-byte-aligned pointers, row strides divisible by 16, unit inner
strides. Prints one JSON object per kernel and exits 1 if any kernel fails to compile. Must run
without TRITON_INTERPRET=1 (the interpreter replaces the compiler).
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
        "tensor_cores": bool(re.search(r"warp_group_dot|nvidia_mma|\bmma\b", ttgir)),
        "pipelined": "async_copy_global_to_local" in ttgir or "async_tma_copy" in ttgir,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument(
        "--arch", type=int, default=90, help="compute capability x10 (90 = H100/H200)"
    )
    parser.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        print(
            "compile_check: unset TRITON_INTERPRET; the interpreter cannot compile", file=sys.stderr
        )
        return 2
    from trainer.kernels import triton_ce

    failed = False
    for dtype_name in args.dtype:
        for kernel in (triton_ce._forward_kernel, triton_ce._dlogits_kernel):
            try:
                print(json.dumps(compile_kernel(kernel, dtype_name, args.arch)), flush=True)
            except Exception as exc:  # report every kernel, then fail
                failed = True
                msg = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                print(
                    f"compile_check: {kernel.__name__} {dtype_name} sm_{args.arch}: {msg}",
                    file=sys.stderr,
                )
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
