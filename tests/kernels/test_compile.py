"""The GPU code compiles for Hopper (sm_90) on this CPU machine, with tensor cores and pipelining.

Runs `python -m trainer.kernels.compile_check` in a subprocess because this test session's Triton is
built for the interpreter, which cannot compile.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import ModuleType

import pytest

from tests import budget

H200_SHARED_LIMIT = 227 * 1024  # bytes of shared memory one block may use on sm_90


@pytest.mark.timeout(120)
def test_bf16_kernels_compile_for_sm90_with_tensor_cores_and_pipelining(
    triton_ce: ModuleType,
) -> None:
    """The training path (bf16) lowers to wgmma with async copies and fits shared memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.kernels.compile_check", "--arch", "90", "--dtype", "bf16"],
        capture_output=True,
        text=True,
        env=env,
        timeout=budget.left(),
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert {r["kernel"] for r in reports} == {"_forward_kernel", "_dlogits_kernel"}
    for report in reports:
        assert report["tensor_cores"], report
        assert report["pipelined"], report
        assert 0 < report["shared_bytes"] <= H200_SHARED_LIMIT, report
