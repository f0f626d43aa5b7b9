"""Shared comparison helpers: failures report max and mean differences, not just 'not close'."""

from __future__ import annotations

import os

import torch


def kernels_on_gpu() -> bool:
    """Kernel tests run compiled on CUDA when a GPU is present or DFLASH_KERNEL_TESTS_CUDA=1."""
    return os.environ.get("DFLASH_KERNEL_TESTS_CUDA") == "1" or torch.cuda.is_available()


def assert_close_report(
    actual: torch.Tensor, expected: torch.Tensor, *, atol: float, rtol: float, what: str
) -> None:
    """assert_close whose message states the max and mean absolute difference."""
    diff = (actual.float() - expected.float()).abs()
    msg = f"{what}: max diff {diff.max().item():.3e}, mean diff {diff.mean().item():.3e}"
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, msg=msg)


def make_case(
    n: int,
    d: int,
    v: int,
    *,
    seed: int,
    scale: float = 1.0,
    ignore_every: int = 0,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random hidden [n, d] (requires grad), frozen weight [v, d], labels with some ignored."""
    gen = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, d, generator=gen) * scale).to(device=device, dtype=dtype)
    weight = (torch.randn(v, d, generator=gen) / d**0.5).to(device=device, dtype=dtype)
    labels = torch.randint(0, v, (n,), generator=gen)
    if ignore_every:
        labels[::ignore_every] = -100
    return hidden.requires_grad_(True), weight, labels.to(device)
