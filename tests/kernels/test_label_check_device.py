"""The LM-head CE's label range check does not wait for the device (issue 16 item 4: it was
a host sync per call, i.e. per drafter micro-step): device labels are checked on the device.
Host labels keep the exact one-line error (tests/kernels/test_api.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests import budget
from trainer.kernels import KernelInputError
from trainer.kernels.lm_head_ce import _check_label_range


def test_device_labels_are_checked_without_reading_them_on_the_host() -> None:
    """Meta tensors have no values: any host read of them raises, so passing proves none."""
    labels = torch.full((7,), 3, dtype=torch.long, device="meta")
    _check_label_range(labels, 30, -100)
    with pytest.raises(RuntimeError, match="meta"):
        bool(labels.any())  # what the check did before


def test_host_labels_still_raise_the_named_error() -> None:
    labels = torch.tensor([1, 30, -100, 31])
    with pytest.raises(KernelInputError, match=r"2 label\(s\) outside \[0, 30\).*e\.g\. 30"):
        _check_label_range(labels, 30, -100)
    _check_label_range(torch.tensor([0, 29, -100]), 30, -100)


CHILD = """
import torch
from trainer.kernels.lm_head_ce import _check_label_range
_check_label_range(torch.tensor([0, 29, -100], device="cuda"), 30, -100)
torch.cuda.synchronize()
print("good labels ok", flush=True)
_check_label_range(torch.tensor([0, 30], device="cuda"), 30, -100)
torch.cuda.synchronize()
print("not reached")
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_bad_cuda_label_fails_the_next_synchronisation() -> None:
    """In a child process: a device-side assert leaves its CUDA context unusable."""
    out = subprocess.run(
        [sys.executable, "-c", CHILD],
        capture_output=True,
        text=True,
        timeout=budget.left(),
        check=False,
    )
    assert out.returncode != 0 and "good labels ok" in out.stdout, out
    assert "not reached" not in out.stdout
    assert "outside [0, 30)" in out.stderr or "device-side assert" in out.stderr, out.stderr
