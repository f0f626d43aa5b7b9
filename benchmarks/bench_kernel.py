"""Fused LM-head cross-entropy: peak memory and time of dense vs chunked (vs Triton on CUDA).

Run:  .venv/bin/python benchmarks/bench_kernel.py [--device cpu|cuda]

Every backend runs the same forward+backward (per-position loss weighted by random upstream
gradients, as the DFlash decayed loss does) at the Qwen3 vocabulary, 151,936, in one process, so
the figures are side by side.

Peak memory is the peak of bytes allocated *during* the call above what existed before it (inputs
and weight excluded, saved activations and gradients included):
- CUDA: torch.cuda.max_memory_allocated() after reset_peak_memory_stats(), minus the baseline.
- CPU: torch has no CPU peak counter, so the call runs once under torch.profiler with
  profile_memory=True, and the allocator's own allocation/free events (every tensor the CPU
  allocator hands out or takes back, with its size and timestamp) are replayed in time order; the
  peak of the running sum is the peak allocation (trainer/kernels/peak_memory.py). RSS sampling
  would miss short-lived peaks and count allocator caching; this counts tensors exactly.
Time is the median of `--repeats` calls (CUDA: after one warm-up, synchronised wall clock).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from trainer.kernels import lm_head_cross_entropy
from trainer.kernels.common import Backend
from trainer.kernels.peak_memory import cpu_peak_bytes, cuda_peak_bytes

QWEN3_VOCAB = 151_936


def median_seconds(fn: Callable[[], None], repeats: int, device: str) -> float:
    if device == "cuda":
        fn()  # warm-up: Triton compilation, cuBLAS handles, allocator growth
    times = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--positions", type=int, help="N (default: cpu 512, cuda 8192 = 512 x 16)")
    parser.add_argument("--hidden", type=int, help="D (default: cpu 256, cuda 4096 = Qwen3-8B)")
    parser.add_argument("--vocab", type=int, default=QWEN3_VOCAB)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda and not torch.cuda.is_available():
        print("bench_kernel: --device cuda but torch sees no CUDA device", file=sys.stderr)
        return 2
    n = args.positions or (8192 if cuda else 512)
    d = args.hidden or (4096 if cuda else 256)
    dtype = torch.bfloat16 if cuda else torch.float32
    backends: list[Backend] = ["dense", "chunked", "triton"] if cuda else ["dense", "chunked"]

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, d, generator=gen).to(args.device, dtype).requires_grad_(True)
    weight = (torch.randn(args.vocab, d, generator=gen) / d**0.5).to(args.device, dtype)
    labels = torch.randint(0, args.vocab, (n,), generator=gen).to(args.device)
    labels[::7] = -100
    upstream = torch.rand(n, generator=gen).to(args.device)
    dense_bytes = n * args.vocab * 4
    print(
        f"device={args.device} dtype={str(dtype).removeprefix('torch.')} N={n} D={d} "
        f"V={args.vocab}  (fp32 [N, V] logits alone = {dense_bytes / 2**20:.0f} MiB)"
    )

    results: dict[Backend, tuple[int, float, float]] = {}
    outputs: dict[Backend, tuple[torch.Tensor, torch.Tensor]] = {}
    for backend in backends:

        def fwd(backend: Backend = backend) -> None:
            with torch.no_grad():
                lm_head_cross_entropy(hidden, weight, labels, backend=backend)

        def fwd_bwd(backend: Backend = backend) -> None:
            hidden.grad = None
            out = lm_head_cross_entropy(hidden, weight, labels, backend=backend)
            torch.autograd.backward((out.loss * upstream).sum())
            assert hidden.grad is not None
            outputs[backend] = (out.loss.detach(), hidden.grad.detach().clone())

        t_fwd = median_seconds(fwd, args.repeats, args.device)
        t_all = median_seconds(fwd_bwd, args.repeats, args.device)
        outputs.pop(backend)  # measure memory without holding an earlier result's clone
        hidden.grad = None
        peak = (cuda_peak_bytes if cuda else cpu_peak_bytes)(fwd_bwd)
        results[backend] = (peak, t_fwd, t_all)

    ref_loss, ref_grad = outputs["dense"]
    print(f"{'backend':<8} {'peak MiB':>9} {'dense/this':>10} {'fwd ms':>9} {'fwd+bwd ms':>11} "
          f"{'max|dloss|':>11} {'max|dgrad|':>11}")  # fmt: skip
    for backend, (peak, t_fwd, t_all) in results.items():
        loss, grad = outputs[backend]
        dl = (loss - ref_loss).abs().max().item()
        dg = (grad.float() - ref_grad.float()).abs().max().item()
        ratio = results["dense"][0] / max(peak, 1)
        print(
            f"{backend:<8} {peak / 2**20:>9.1f} {ratio:>9.1f}x {t_fwd * 1e3:>9.1f} "
            f"{t_all * 1e3:>11.1f} {dl:>11.2e} {dg:>11.2e}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
