"""The kernel tests pass whatever imported triton first (torch, transformers, a test module collected
before tests/kernels): tests/conftest.py builds triton.language for the interpreter before any test
module, and trainer.kernels.triton_ce names a mode mismatch at import instead of failing at launch.

Each case is a fresh interpreter, because triton's mode is fixed for a process at its first import.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests import budget
from tests.kernels.conftest import CUDA_RUN

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(CUDA_RUN, reason="with a GPU the kernels compile; nothing is interpreted"),
]

KERNEL_CALL = """
import torch
from tests.kernels.helpers import make_case
from trainer.kernels.reference import dense_lm_head_cross_entropy
hidden, weight, labels = make_case(7, 40, 300, seed=1, ignore_every=3)
out = triton_ce.triton_lm_head_cross_entropy(hidden, weight, labels, -100)
ref = dense_lm_head_cross_entropy(hidden, weight, labels, -100)
torch.testing.assert_close(out.loss, ref.loss, atol=1e-4, rtol=1e-5)
print("kernels ran", triton_ce.INTERPRETED)
"""


def _python(code: str) -> subprocess.CompletedProcess[str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in {"TRITON_INTERPRET", "DFLASH_KERNEL_TESTS_CUDA"}
    }
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=budget.left(),
        check=False,
    )


def test_triton_imported_before_the_kernels_still_interprets(triton_ce: ModuleType) -> None:
    """The suite's guard (importing tests.conftest, as pytest does first), then triton imported
    without TRITON_INTERPRET, as torch or a model test does: the kernels still run interpreted."""
    code = "import tests.conftest, os, triton\n"
    code += "os.environ['TRITON_INTERPRET'] = '1'\n"
    code += "import trainer.kernels.triton_ce as triton_ce\n" + KERNEL_CALL
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "kernels ran True" in done.stdout


def test_a_mode_mismatch_is_named_at_import(triton_ce: ModuleType) -> None:
    """Without the guard, triton imported compiled and the kernels interpreted is an ImportError
    that says why, not "Cannot call @triton.jit'd outside of the scope of a kernel" at launch."""
    code = "import os, triton\n"
    code += "os.environ['TRITON_INTERPRET'] = '1'\n"
    code += "try:\n    import trainer.kernels.triton_ce\n"
    code += "except ImportError as exc:\n    print('ImportError:', exc)\n"
    done = _python(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (
        "triton.language was built for compilation but these kernels for the CPU interpreter"
        in (done.stdout)
    )
