"""Chunked soft-label CE (logit distillation): equal to a dense torch reference written here,
in loss and gradient, and its forward+backward never holds [N, V] (measured, not claimed)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.kernels.helpers import assert_close_report, make_case
from trainer.kernels import (
    KernelInputError,
    lm_head_cross_entropy,
    lm_head_distill_cross_entropy,
    lm_head_soft_cross_entropy,
)
from trainer.kernels.peak_memory import cpu_peak_bytes


def _dense_soft_ce(student: torch.Tensor, teacher: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """-sum_v softmax(teacher W^T)_v log softmax(student W^T)_v, from full logits."""
    p = torch.softmax((teacher @ w.t()).float(), dim=-1)
    return -(p * torch.log_softmax((student @ w.t()).float(), dim=-1)).sum(-1)


def _case(n: int, d: int, v: int, seed: int, scale: float) -> tuple[torch.Tensor, ...]:
    student, weight, _ = make_case(n, d, v, seed=seed, scale=scale)
    g = torch.Generator().manual_seed(seed + 1)
    teacher = torch.randn(n, d, generator=g) * scale
    return student, teacher, weight


@settings(max_examples=30, deadline=None)
@given(
    n=st.integers(1, 40),
    d=st.integers(1, 48),
    v=st.integers(2, 700),
    chunk=st.integers(1, 300),
    seed=st.integers(0, 2**16),
    scale=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_chunked_soft_ce_matches_dense(
    n: int, d: int, v: int, chunk: int, seed: int, scale: float
) -> None:
    """Any chunk width (1, ragged, wider than V) gives the dense loss and student gradient."""
    student, teacher, weight = _case(n, d, v, seed, scale)
    upstream = torch.rand(n, generator=torch.Generator().manual_seed(seed)) + 0.5
    got = lm_head_soft_cross_entropy(student, teacher, weight, chunk_size=chunk)
    ref = _dense_soft_ce(student, teacher, weight)
    assert_close_report(got, ref, atol=2e-4, rtol=1e-5, what="soft CE")
    (g_got,) = torch.autograd.grad((got * upstream).sum(), student)
    (g_ref,) = torch.autograd.grad((ref * upstream).sum(), student)
    # q - p cancels where both distributions are sharp: fp32 roundoff ~1e-5 either way
    assert_close_report(g_got, g_ref, atol=1e-4, rtol=1e-4, what="grad_student")


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 30),
    v=st.integers(2, 500),
    chunk=st.integers(1, 200),
    seed=st.integers(0, 2**16),
    g_soft=st.sampled_from([0.0, 0.3, 1.0]),
    g_hard=st.sampled_from([0.0, 0.7, 1.0]),
)
def test_the_same_pass_gives_the_hard_ce_argmax_and_mixed_gradients(
    n: int, v: int, chunk: int, seed: int, g_soft: float, g_hard: float
) -> None:
    """hard and correct equal the dense CE and argmax; the gradient of any mix
    g_soft * soft + g_hard * hard (one of them absent from the graph, or both) is the dense
    one's."""
    student, teacher, weight = _case(n, 24, v, seed, 3.0)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed))
    got = lm_head_distill_cross_entropy(student, teacher, weight, labels, chunk_size=chunk)
    logits = (student @ weight.t()).float()
    hard = torch.nn.functional.cross_entropy(logits, labels, reduction="none")
    assert_close_report(got.hard, hard, atol=1e-4, rtol=1e-5, what="hard CE")
    assert torch.equal(got.correct, logits.argmax(-1) == labels)
    if g_soft == g_hard == 0.0:
        return
    mix = (g_soft * got.soft if g_soft else 0) + (g_hard * got.hard if g_hard else 0)
    ref = g_soft * _dense_soft_ce(student, teacher, weight) + g_hard * hard
    (g_got,) = torch.autograd.grad(torch.as_tensor(mix).sum(), student)
    (g_ref,) = torch.autograd.grad(ref.sum(), student)
    assert_close_report(g_got, g_ref, atol=1e-4, rtol=1e-4, what="grad of the mix")


def test_a_one_hot_teacher_is_the_hard_label_ce() -> None:
    """A teacher so sharp its distribution is one-hot on label y gives CE(student, y)."""
    student, weight, _ = make_case(12, 32, 20, seed=3)  # V <= D: any logits are reachable
    labels = torch.randint(0, 20, (12,), generator=torch.Generator().manual_seed(4))
    # teacher hidden whose logits are 1e3 * onehot(y): softmax is one-hot to fp32 precision
    teacher = torch.linalg.lstsq(weight, torch.eye(20)[:, labels] * 1e3).solution.t()
    soft = lm_head_soft_cross_entropy(student, teacher.contiguous(), weight, chunk_size=7)
    hard = lm_head_cross_entropy(student, weight, labels, backend="chunked", chunk_size=7)
    assert_close_report(soft, hard.loss, atol=1e-3, rtol=1e-4, what="one-hot soft CE")


def test_the_teacher_gets_no_gradient_and_a_trainable_head_is_refused() -> None:
    student, teacher, weight = _case(4, 8, 20, seed=0, scale=1.0)
    teacher.requires_grad_(True)
    torch.autograd.backward(lm_head_soft_cross_entropy(student, teacher, weight).sum())
    assert teacher.grad is None and student.grad is not None
    with pytest.raises(KernelInputError, match="weight requires grad"):
        lm_head_soft_cross_entropy(student, teacher, weight.clone().requires_grad_(True))
    with pytest.raises(KernelInputError, match=r"both be \[N, D\]"):
        lm_head_soft_cross_entropy(student, teacher[:3], weight)
    with pytest.raises(KernelInputError, match=r"1 label\(s\) outside \[0, 20\), e.g. 20"):
        lm_head_distill_cross_entropy(student, teacher, weight, torch.tensor([0, 1, 20, 3]))


def test_no_rows_give_an_empty_loss_that_backprops() -> None:
    student, teacher, weight = _case(0, 8, 20, seed=0, scale=1.0)
    out = lm_head_soft_cross_entropy(student, teacher, weight)
    torch.autograd.backward(out.sum())
    assert out.shape == (0,) and student.grad is not None


def _peak(fn_loss: object) -> int:
    assert callable(fn_loss)
    return cpu_peak_bytes(lambda: torch.autograd.backward(fn_loss().sum()))


def test_distillation_peak_is_a_fraction_of_one_logits_matrix_like_the_ce() -> None:
    """Forward+backward of the chunked soft CE stays under a quarter of one [N, V] fp32 matrix
    (the chunked CE's bound), while the dense reference holds several of them."""
    n, d, v, chunk = 128, 32, 12_000, 1024
    logits_bytes = n * v * 4
    student, teacher, weight = _case(n, d, v, seed=0, scale=1.0)
    labels = torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(0))
    kd = _peak(lambda: lm_head_soft_cross_entropy(student, teacher, weight, chunk_size=chunk))
    ce = _peak(
        lambda: (
            lm_head_cross_entropy(student, weight, labels, backend="chunked", chunk_size=chunk).loss
        )
    )
    dense = _peak(lambda: _dense_soft_ce(student, teacher, weight))
    # the default widths (here the CE's width cap binds, not its byte budget): same bound
    kd_default = _peak(lambda: lm_head_soft_cross_entropy(student, teacher, weight))
    ce_default = _peak(
        lambda: lm_head_cross_entropy(student, weight, labels, backend="chunked").loss
    )
    assert kd_default <= 1.1 * ce_default, (kd_default, ce_default)
    assert dense >= 2 * logits_bytes, f"dense peak {dense} should hold several [N, V] matrices"
    assert kd < logits_bytes / 4, f"chunked KD peak {kd} vs one logits matrix {logits_bytes}"
    # two tiles (student's and teacher's) where the CE keeps one: at most ~2x the CE's peak
    assert kd <= 2 * ce + n * d * 4, (kd, ce)
