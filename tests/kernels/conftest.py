"""Build the Triton kernels for the CPU interpreter before any kernel test runs.

Triton's `@triton.jit` reads TRITON_INTERPRET when a decorated module is imported (triton's own
`triton.language` helpers included), and the launcher reads it again at every call, so the variable
is set around the import of the kernels here and again, through monkeypatch, while each Triton
test runs. triton.language itself is built for the interpreter by tests/conftest.py before any test
module is collected (torch, transformers and trainer.model import triton, and a test directory
collected before this one would otherwise build its helpers compiled). Between those it is restored: a leaked TRITON_INTERPRET=1 would switch every other
test's backend="auto" onto the slow interpreter. Where torch sees a GPU (or
DFLASH_KERNEL_TESTS_CUDA=1, which benchmarks/gpu.sh sets) the interpreter is never touched: the
kernels are compiled and the tests run them on the GPU, and other tests' torch.compile keeps a
compiling Triton.
"""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest

from tests.conftest import require_part
from tests.kernels.helpers import kernels_on_gpu

CUDA_RUN = kernels_on_gpu()


def _import_triton_module() -> tuple[ModuleType | None, str]:
    if CUDA_RUN:
        try:
            return importlib.import_module("trainer.kernels.triton_ce"), ""
        except ImportError as exc:
            return None, f"triton does not import: {exc}"
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        module = importlib.import_module("trainer.kernels.triton_ce")
        if not module.INTERPRETED:
            module = importlib.reload(sys.modules["trainer.kernels.triton_ce"])
        return module, ""
    except ImportError as exc:
        return None, f"triton does not import: {exc}"
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


TRITON_MODULE, TRITON_MISSING = _import_triton_module()


@pytest.fixture
def triton_ce(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The Triton kernel module, interpreted on CPU (or compiled under the GPU script)."""
    require_part(TRITON_MODULE is not None, TRITON_MISSING)
    assert TRITON_MODULE is not None
    if TRITON_MODULE.INTERPRETED:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    return TRITON_MODULE


@pytest.fixture
def kernel_device() -> str:
    """Where the Triton kernels run in this session: the GPU under the GPU script, else CPU."""
    if CUDA_RUN:
        import torch

        require_part(torch.cuda.is_available(), "DFLASH_KERNEL_TESTS_CUDA=1 but torch sees no GPU")
        return "cuda"
    return "cpu"
