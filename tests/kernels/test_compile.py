"""The GPU code compiles for Hopper (sm_90), B200 (sm_100) and Blackwell workstation GPUs (sm_120)
on this CPU machine, with tensor cores and pipelining, and every kernel fits the architecture's
shared memory per block (issue 26: sm_120 allows 101,376 B).

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
from trainer.kernels.devices import SHARED_MEMORY_OPTIN

ARCHS = (90, 100, 120)


def _compile_check(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    return subprocess.run(
        [sys.executable, "-m", "trainer.kernels.compile_check", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=budget.left(),
    )


def _reports(proc: subprocess.CompletedProcess[str]) -> list[dict[str, object]]:
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.mark.timeout(240)
def test_bf16_kernels_compile_for_sm90_sm100_sm120_and_fit_shared_memory(
    triton_ce: ModuleType,
) -> None:
    """The training path (bf16): CE kernels lower to tensor cores with async copies; every
    kernel, flex_attention's chosen tiles included, fits the architecture's limit."""
    proc = _compile_check("--arch", *map(str, ARCHS), "--dtype", "bf16")
    assert proc.returncode == 0, proc.stderr[-2000:]
    reports = _reports(proc)
    for arch in ARCHS:
        mine = {str(r["kernel"]): r for r in reports if r["arch"] == arch}
        assert set(mine) == {
            "_forward_kernel",
            "_dlogits_kernel",
            "flex_attention_fwd",
            "flex_attention_bwd",
        }
        for report in mine.values():
            assert report["limit"] == SHARED_MEMORY_OPTIN[arch]
            shared = report["shared_bytes"]
            assert isinstance(shared, int) and 0 < shared <= SHARED_MEMORY_OPTIN[arch], report
        for name in ("_forward_kernel", "_dlogits_kernel"):
            assert mine[name]["measured"] and mine[name]["tensor_cores"], mine[name]
            assert mine[name]["pipelined"], mine[name]
        assert not mine["flex_attention_bwd"]["measured"]


@pytest.mark.timeout(240)
def test_a_kernel_over_the_limit_fails_naming_it(triton_ce: ModuleType) -> None:
    """The check fires: under a 60,000 B limit the CE kernels (64 KiB on sm_120) do not fit."""
    proc = _compile_check("--arch", "120", "--dtype", "bf16", "--limit", "60000")
    assert proc.returncode == 1
    assert "_forward_kernel bf16 sm_120 needs 65,536 B of shared memory per block, more than " in (
        proc.stderr
    )
    assert "the 60,000 B allowed" in proc.stderr
