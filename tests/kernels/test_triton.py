"""The Triton kernels (CPU interpreter here, real GPU under benchmarks/gpu.sh) equal the dense reference.

Shapes are deliberately not multiples of the tiles (interpreter tiles: 16 rows x 128 vocab x 16
hidden), so every masked edge of the kernels is exercised.
"""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.kernels.helpers import assert_close_report, kernels_on_gpu, make_case
from trainer.kernels import BackendUnavailableError, lm_head_cross_entropy, select_backend
from trainer.kernels.reference import dense_lm_head_cross_entropy

pytestmark = pytest.mark.timeout(60)

# bf16 kernels only make sense on the GPU run; CPU inputs are fp32 (the interpreter is numpy).
DTYPES = ["float32", "bfloat16"] if kernels_on_gpu() else ["float32"]


def _reference(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, upstream: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense fp32 loss, flags and gradient from the same (possibly bf16-rounded) values."""
    h = hidden.detach().float().requires_grad_(True)
    ref = dense_lm_head_cross_entropy(h, weight.float(), labels, -100)
    (grad,) = torch.autograd.grad((ref.loss * upstream).sum(), h)
    return ref.loss.detach(), ref.correct, grad


def _check(
    triton_ce: ModuleType,
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    **kwargs: object,
) -> None:
    upstream = torch.linspace(0.5, 1.5, hidden.shape[0], device=hidden.device)
    ref_loss, ref_correct, ref_grad = _reference(hidden, weight, labels, upstream)
    out = triton_ce.triton_lm_head_cross_entropy(hidden, weight, labels, -100, **kwargs)
    (grad,) = torch.autograd.grad((out.loss * upstream).sum(), hidden)
    assert out.loss.dtype == torch.float32 and out.correct.dtype == torch.bool
    assert grad.dtype == hidden.dtype
    low = hidden.dtype != torch.float32
    # bf16: logits are exact products with fp32 sums; dlogits are rounded to bf16 before the GEMM.
    assert_close_report(out.loss, ref_loss, atol=1e-4, rtol=1e-4 if low else 1e-5, what="loss")
    assert torch.equal(out.correct, ref_correct), "argmax-correctness differs from torch.argmax"
    g_atol = 2e-2 * ref_grad.abs().max().item() if low else 1e-5
    assert_close_report(grad, ref_grad, atol=g_atol, rtol=2e-2 if low else 1e-4, what="grad_hidden")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("n", "d", "v"),
    [(1, 16, 37), (7, 40, 37), (64, 64, 37), (1, 40, 300), (7, 64, 300), (64, 16, 300),
     (1, 64, 1000), (7, 16, 1000), (64, 40, 1000)],
)  # fmt: skip
def test_triton_matches_dense(
    triton_ce: ModuleType, kernel_device: str, dtype: str, n: int, d: int, v: int
) -> None:
    """Loss, correctness flags and grad_hidden over ragged shapes, with every third label ignored."""
    hidden, weight, labels = make_case(
        n, d, v, seed=n * d + v, ignore_every=3, dtype=getattr(torch, dtype), device=kernel_device
    )
    _check(triton_ce, hidden, weight, labels)


@pytest.mark.parametrize("num_splits", [1, 3, 50])
def test_vocab_splits_and_backward_chunks_do_not_change_results(
    triton_ce: ModuleType, kernel_device: str, num_splits: int
) -> None:
    """Merging split partials and chunking the backward are exact reorganisations of the sum."""
    hidden, weight, labels = make_case(20, 32, 333, seed=5, ignore_every=4, device=kernel_device)
    _check(triton_ce, hidden, weight, labels, num_splits=num_splits, chunk=64)


def test_argmax_ties_resolve_to_lowest_id_within_and_across_tiles_and_splits(
    triton_ce: ModuleType, kernel_device: str
) -> None:
    """Exactly equal logits: inside one tile, across tiles, across splits, and all-equal rows."""
    v, d = 400, 16
    weight = torch.zeros(v, d)
    # Interpreter tiles are 128 wide and 2 splits cover [0, 256) and [256, 400):
    weight[[5, 6, 130, 300], 0] = 1.0  # 5/6 share a tile, 130 is a later tile, 300 a later split
    weight[[20, 380], 1] = 1.0  # second tie group, different splits
    hidden = torch.zeros(4, d)
    hidden[0, 0] = 2.0
    hidden[1, 0] = 2.0
    hidden[2, 1] = 3.0  # row 3 stays zero: every logit ties and id 0 wins
    labels = torch.tensor([5, 6, 20, 0])
    hidden, weight, labels = (t.to(kernel_device) for t in (hidden, weight, labels))
    out = triton_ce.triton_lm_head_cross_entropy(
        hidden.requires_grad_(True), weight, labels, -100, num_splits=2
    )
    assert out.correct.tolist() == [True, False, True, True]
    torch.testing.assert_close(
        out.loss, dense_lm_head_cross_entropy(hidden, weight, labels, -100).loss
    )


def test_large_logits_are_stable(triton_ce: ModuleType, kernel_device: str) -> None:
    """Logits of order 1e4 would overflow a naive exp; the online log-sum-exp keeps them finite."""
    hidden, weight, labels = make_case(9, 32, 257, seed=3, scale=3e3, device=kernel_device)
    out = triton_ce.triton_lm_head_cross_entropy(hidden, weight, labels, -100)
    ref = dense_lm_head_cross_entropy(hidden, weight, labels, -100)
    assert torch.isfinite(out.loss).all()
    assert_close_report(out.loss, ref.loss, atol=1e-2, rtol=1e-5, what="loss")
    (grad,) = torch.autograd.grad(out.loss.sum(), hidden)
    assert torch.isfinite(grad).all()


def test_non_contiguous_hidden_uses_its_strides(triton_ce: ModuleType, kernel_device: str) -> None:
    """A transposed view (stride (1, N)) is read through its strides, not as if contiguous."""
    base, weight, labels = make_case(24, 48, 100, seed=9, device=kernel_device)
    hidden = base.detach().t().contiguous().t().requires_grad_(True)
    assert not hidden.is_contiguous()
    _check(triton_ce, hidden, weight, labels)


def test_all_positions_ignored_gives_zero_loss_and_grad(
    triton_ce: ModuleType, kernel_device: str
) -> None:
    """A batch with no supervised position contributes nothing and stays NaN-free."""
    hidden, weight, labels = make_case(5, 16, 40, seed=2, device=kernel_device)
    labels.fill_(-100)
    out = triton_ce.triton_lm_head_cross_entropy(hidden, weight, labels, -100)
    (grad,) = torch.autograd.grad(out.loss.sum(), hidden)
    assert out.loss.eq(0).all() and not out.correct.any() and grad.eq(0).all()


def test_auto_picks_triton_under_the_interpreter(
    triton_ce: ModuleType, kernel_device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With TRITON_INTERPRET=1 (or CUDA tensors) the public API routes "auto" to the kernels."""
    if kernel_device == "cpu":  # on CUDA, the device alone must select Triton
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    else:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("auto", torch.device(kernel_device)) == "triton"
    hidden, weight, labels = make_case(7, 16, 37, seed=4, ignore_every=2, device=kernel_device)
    out = lm_head_cross_entropy(hidden, weight, labels, backend="auto")
    ref = dense_lm_head_cross_entropy(hidden, weight, labels, -100)
    assert out.loss.grad_fn is not None and "Triton" in type(out.loss.grad_fn).__name__
    assert_close_report(out.loss, ref.loss, atol=1e-4, rtol=1e-5, what="loss")


def test_interpreter_refuses_half_precision(triton_ce: ModuleType, kernel_device: str) -> None:
    """bf16 on the CPU interpreter would be garbage: explicit triton refuses, auto falls back."""
    if kernel_device != "cpu":
        pytest.skip("interpreter-only behaviour; the GPU run checks bf16 numerics instead")
    hidden, weight, labels = make_case(7, 32, 100, seed=6, dtype=torch.bfloat16)
    with pytest.raises(BackendUnavailableError, match="float32 inputs only"):
        lm_head_cross_entropy(hidden, weight, labels, backend="triton")
    assert select_backend("auto", hidden.device, hidden.dtype) == "chunked"


def test_gpu_tile_shapes_give_the_same_results(triton_ce: ModuleType, kernel_device: str) -> None:
    """The shipped CUDA tiles (128 x 128 x 64), run here too, agree with dense on ragged shapes."""
    gpu_tiles = triton_ce.TileConfig(
        block_n=128, block_v=128, block_d=64, num_warps=8, num_stages=3
    )
    hidden, weight, labels = make_case(130, 72, 300, seed=8, ignore_every=5, device=kernel_device)
    _check(triton_ce, hidden, weight, labels, tiles=gpu_tiles, num_splits=2, chunk=128)
