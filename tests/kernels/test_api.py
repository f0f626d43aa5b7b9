"""Input validation and backend selection of lm_head_cross_entropy: clear one-line errors."""

from __future__ import annotations

from types import ModuleType

import pytest
import torch

from tests.kernels.helpers import make_case
from trainer.kernels import (
    BackendUnavailableError,
    KernelInputError,
    lm_head_cross_entropy,
    select_backend,
)


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda h, w, lab: (h[None], w, lab), "hidden must be [N, D]"),
        (lambda h, w, lab: (h, w[:, :-1], lab), "hidden size mismatch"),
        (lambda h, w, lab: (h, w, lab[:-1]), "labels must be [N=5]"),
        (lambda h, w, lab: (h, w.double(), lab), "share a float dtype"),
        (lambda h, w, lab: (h, w, lab.float()), "integer class ids"),
        (lambda h, w, lab: (h, w, lab.clone().fill_(30)), "outside [0, 30)"),
        (lambda h, w, lab: (h, w, lab.clone().fill_(-1)), "e.g. -1"),
        (lambda h, w, lab: (h, w.clone().requires_grad_(True), lab), "weight requires grad"),
    ],
)
def test_bad_inputs_raise_one_line_errors(mutate, needle: str) -> None:  # type: ignore[no-untyped-def]
    """Each misuse names the offending argument in a single line instead of computing garbage."""
    h, w, lab = mutate(*make_case(5, 8, 30, seed=0))
    with pytest.raises(KernelInputError) as info:
        lm_head_cross_entropy(h, w, lab, backend="chunked")
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_unknown_backend_is_rejected() -> None:
    """A typo in the backend name fails loudly rather than falling back."""
    with pytest.raises(KernelInputError, match="backend must be one of"):
        select_backend("trtion", torch.device("cpu"))


def test_int32_labels_are_accepted() -> None:
    """Token stores hold int32 ids; they are widened instead of rejected."""
    h, w, lab = make_case(5, 8, 30, seed=0)
    a = lm_head_cross_entropy(h, w, lab.int(), backend="chunked")
    b = lm_head_cross_entropy(h, w, lab, backend="dense")
    torch.testing.assert_close(a.loss, b.loss)


def test_weight_with_grad_is_fine_under_no_grad() -> None:
    """Evaluation under torch.no_grad may pass a trainable weight: nothing is differentiated."""
    h, w, lab = make_case(5, 8, 30, seed=0)
    with torch.no_grad():
        out = lm_head_cross_entropy(h, w.requires_grad_(True), lab, backend="chunked")
    assert out.loss.shape == (5,)


def test_auto_on_cpu_without_interpreter_is_chunked(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without CUDA and without TRITON_INTERPRET=1, auto runs the pure-torch path."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert select_backend("auto", torch.device("cpu")) == "chunked"


def test_explicit_triton_on_cpu_without_interpreter_says_why(
    triton_ce: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Asking for Triton where it cannot run is an error naming the fix, not a silent fallback."""
    monkeypatch.setattr(triton_ce, "INTERPRETED", False)
    with pytest.raises(BackendUnavailableError, match="TRITON_INTERPRET=1") as info:
        select_backend("triton", torch.device("cpu"))
    assert "\n" not in str(info.value)


def test_explicit_triton_without_triton_installed_says_why(monkeypatch: pytest.MonkeyPatch) -> None:
    """A container without triton gets the import failure and the alternative in one line."""
    from trainer.kernels import lm_head_ce

    def broken_import() -> ModuleType:
        raise ImportError("No module named 'triton'")

    monkeypatch.setattr(lm_head_ce, "_triton", broken_import)
    with pytest.raises(BackendUnavailableError, match="triton failed to import") as info:
        select_backend("triton", torch.device("cuda"))
    assert "backend='chunked'" in str(info.value)
    assert select_backend("auto", torch.device("cuda")) == "chunked"


def test_non_positive_chunk_size_is_rejected() -> None:
    """chunk_size=0 or negative is a caller bug, reported instead of silently replaced."""
    h, w, lab = make_case(5, 8, 30, seed=0)
    for bad in (0, -4):
        with pytest.raises(KernelInputError, match="chunk_size must be positive"):
            lm_head_cross_entropy(h, w, lab, backend="chunked", chunk_size=bad)
