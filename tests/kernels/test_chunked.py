"""The chunked pure-torch path equals the dense reference in loss, correctness and gradients."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.helpers import assert_close_report, make_case
from trainer.kernels import lm_head_cross_entropy
from trainer.kernels.common import Backend


def _grads(hidden: torch.Tensor, loss: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    (grad,) = torch.autograd.grad((loss * upstream).sum(), hidden)
    return grad


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 48),
    v=st.integers(2, 700),
    chunk=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    ignore_every=st.sampled_from([0, 2, 3]),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_chunked_matches_dense(
    n: int, d: int, v: int, chunk: int, seed: int, ignore_every: int, scale: float
) -> None:
    """Any chunk width (including 1 and wider than V) gives the dense loss, flags and gradient."""
    hidden, weight, labels = make_case(n, d, v, seed=seed, scale=scale, ignore_every=ignore_every)
    upstream = torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.5
    ref = lm_head_cross_entropy(hidden, weight, labels, backend="dense")
    got = lm_head_cross_entropy(hidden, weight, labels, backend="chunked", chunk_size=chunk)
    assert_close_report(got.loss, ref.loss, atol=1e-4, rtol=1e-5, what="loss")
    assert torch.equal(got.correct, ref.correct)
    assert_close_report(
        _grads(hidden, got.loss, upstream),
        _grads(hidden, ref.loss, upstream),
        atol=1e-5,
        rtol=1e-4,
        what="grad_hidden",
    )


def test_ignored_positions_have_zero_loss_false_correct_and_zero_grad() -> None:
    """ignore_index rows contribute nothing, even when their hidden state would predict 'correctly'."""
    hidden, weight, labels = make_case(6, 8, 50, seed=1)
    labels[[0, 4]] = -7
    out = lm_head_cross_entropy(
        hidden, weight, labels, ignore_index=-7, backend="chunked", chunk_size=16
    )
    assert out.loss[[0, 4]].eq(0).all() and not out.correct[[0, 4]].any()
    assert out.loss[[1, 2, 3, 5]].gt(0).all()
    (grad,) = torch.autograd.grad(out.loss.sum(), hidden)
    assert grad[[0, 4]].eq(0).all() and grad[[1, 2, 3, 5]].abs().sum(dim=1).gt(0).all()


def test_argmax_ties_pick_lowest_index_across_chunks() -> None:
    """Equal logits in two chunks: the earlier (lower) vocabulary id is the prediction, like torch.argmax."""
    hidden = torch.ones(3, 2)
    weight = torch.zeros(10, 2)
    weight[[3, 7]] = 1.0  # rows 3 and 7 tie for the max; chunk width 4 splits them
    labels = torch.tensor([3, 7, 0])
    out = lm_head_cross_entropy(hidden, weight, labels, backend="chunked", chunk_size=4)
    assert out.correct.tolist() == [True, False, False]


def test_large_logits_stay_finite() -> None:
    """Logits around 1e4 (fp32 exp overflows at ~88) give the dense loss, not inf or nan."""
    hidden, weight, labels = make_case(9, 16, 257, seed=3, scale=3e3)
    ref = lm_head_cross_entropy(hidden, weight, labels, backend="dense")
    got = lm_head_cross_entropy(hidden, weight, labels, backend="chunked", chunk_size=64)
    assert torch.isfinite(got.loss).all()
    assert_close_report(got.loss, ref.loss, atol=1e-2, rtol=1e-5, what="loss")


@pytest.mark.parametrize("backend", ["chunked", "dense"])
def test_empty_batch(backend: Backend) -> None:
    """N = 0 returns empty results and a zero-size gradient instead of failing."""
    hidden, weight, labels = make_case(0, 8, 20, seed=0)
    out = lm_head_cross_entropy(hidden, weight, labels, backend=backend)
    assert out.loss.shape == (0,) and out.correct.shape == (0,) and out.correct.dtype == torch.bool
    torch.autograd.backward(out.loss.sum())
    assert hidden.grad is not None and hidden.grad.shape == (0, 8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accumulators_stay_fp32_under_a_bf16_default(dtype: torch.dtype) -> None:
    """The process default dtype is global (a thread loading a bf16 target flips it): the
    running max/sum and label logit are fp32 whatever it is, so the loss is bit-identical.
    (Type promotion already lifted the old defaulted accumulators to fp32 after the first
    chunk; this guards an in-place rewrite, which would keep them bf16.)"""
    hidden, weight, labels = make_case(64, 32, 1000, seed=3, scale=4.0, dtype=dtype)
    ref = lm_head_cross_entropy(hidden, weight, labels, backend="chunked", chunk_size=128)
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        got = lm_head_cross_entropy(hidden, weight, labels, backend="chunked", chunk_size=128)
    finally:
        torch.set_default_dtype(before)
    assert got.loss.dtype == torch.float32
    assert torch.equal(got.loss, ref.loss)
    assert torch.equal(got.correct, ref.correct)
