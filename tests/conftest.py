"""Suite-wide test policy.

Tests that need real parts (sshd, LXC, tmux, the trainer's torch stack) call `require_part`.
Locally a missing part skips the test with the reason; with CI=true it fails, because a skipped
real-parts test in CI would make a green run lie.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import pytest_timeout

from tests import budget

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def _gpu_may_run_kernels() -> bool:
    """What tests/kernels/helpers.kernels_on_gpu answers, without importing torch on a machine
    with no GPU device node (torch.cuda cannot see a GPU there)."""
    if os.environ.get("DFLASH_KERNEL_TESTS_CUDA") == "1":
        return True
    dev = Path("/dev")
    if not (any(dev.glob("nvidia[0-9]*")) or (dev / "kfd").exists() or (dev / "dxg").exists()):
        return False
    import torch

    return bool(torch.cuda.is_available())


def _build_triton_language_for_the_interpreter() -> None:
    """Import triton once, before any test module, with TRITON_INTERPRET=1 where the kernel tests
    will interpret (no GPU), then restore the variable.

    triton.language's own jit helpers (tl.max, tl.argmax, tl.sum) read TRITON_INTERPRET when
    triton is first imported, and torch, transformers and trainer.model import triton: a test
    module collected before tests/kernels would build them compiled, and the interpreted kernels
    would then fail calling them. Only the import is guarded: the variable itself stays as it was,
    so other tests' backend="auto" does not switch onto the interpreter. With a GPU nothing happens
    (the kernels, and torch.compile's Triton, compile).
    """
    if "triton" in sys.modules or importlib.util.find_spec("triton") is None:
        return
    if _gpu_may_run_kernels():
        return
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        importlib.import_module("triton.language")
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


_build_triton_language_for_the_interpreter()


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """Each test starts without a budget; the timer hook below gives it one."""
    budget.begin(None)
    yield
    budget.begin(None)


@pytest.hookimpl(tryfirst=True, optionalhook=True)  # optional: `-p no:timeout` still runs
def pytest_timeout_set_timer(item: pytest.Item, settings: pytest_timeout.Settings) -> bool:
    """pytest-timeout's timer, started with the test's timeout scaled by how loaded the machine
    is now (`tests.budget.contention`): one overall budget per test, which the waits in
    tests.budget share (docs/design.md). A quiet machine keeps the timeouts as written."""
    seconds = budget.scaled(settings.timeout, budget.contention())
    budget.begin(seconds)
    return bool(pytest_timeout.pytest_timeout_set_timer(item, settings._replace(timeout=seconds)))


def require_part(available: bool, reason: str) -> None:
    """Skip (locally) or fail (in CI) when a real part the test needs cannot be started."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a required part is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    """A fresh tmpfs of `size` (mount's syntax: "4m") at `path` (created), unmounted after: a
    real filesystem that fills up (needs root and mount permission)."""
    path.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    require_part(mounted.returncode == 0, f"cannot mount a tmpfs: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


@pytest.fixture
def small_fs(tmp_path: Path) -> Iterator[Path]:
    """A fresh 4 MiB tmpfs at tmp_path/fs."""
    with tmpfs(tmp_path / "fs", "4m") as mnt:
        yield mnt


REPO = Path(__file__).resolve().parents[1]


def headless_demo_argv(demo_dir: Path, session: str, duration: int) -> list[str]:
    """`python -m dflashctl demo --headless` in `demo_dir` on tmux session `session` (the real
    trainer under real tmux, as `make demo` runs it without a tty); needs tmux and torch."""
    require_part(shutil.which("tmux") is not None, "tmux is not installed")
    require_part(importlib.util.find_spec("torch") is not None, "torch (the train extra) missing")
    demo = [sys.executable, "-m", "dflashctl", "demo", "--dir", str(demo_dir)]
    return [*demo, "--session", session, "--headless", "--duration", str(duration)]


def demo_processes(demo_dir: Path) -> list[str]:
    """`pid cmdline` of every process working under `demo_dir` (the supervisor, the trainer and
    its workers run in the demo's workdir, the pane's shell too)."""
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(proc / "cwd")
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile, or a kernel thread
            continue
        if cwd == str(demo_dir) or cwd.startswith(f"{demo_dir}/"):
            found.append(f"{proc.name} {cmd.strip()}")
    return found


DEMO_STOP_S = 90.0
"""What a headless demo needs after its --duration to stop its run (demo.STOP_TIMEOUT_S) and
print its last lines."""


def run_headless_demo(
    demo_dir: Path, session: str, *until: str
) -> subprocess.CompletedProcess[str]:
    """`dflashctl demo --headless` in `demo_dir` on tmux session `session` (killed afterwards,
    whatever happened): the real trainer under real tmux, as `make demo` runs it without a tty.
    It stops on `until` (the run's progress: `--evals N`, `--until-step N`), its --duration
    being what is left of the test's budget, so a loaded machine shows the same run, later."""
    overall = budget.left()
    argv = headless_demo_argv(demo_dir, session, round(max(overall - DEMO_STOP_S, 1.0)))
    argv += until
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        return subprocess.run(
            argv, cwd=REPO, env=env, capture_output=True, text=True, timeout=overall
        )
    finally:
        subprocess.run(
            ["tmux", "-L", "dflash", "kill-session", "-t", f"={session}"],
            check=False,
            capture_output=True,
        )


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the real Qwen3 tokenizer (unpacked from tests/fixtures once)."""
    from tests.fixtures.qwen3 import unpack_qwen3_tokenizer

    return unpack_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"))


# vLLM's CPU build as a real serving engine, one server per session (tests/serving/engine.py);
# a drafter distilled from a target it can learn, served by its own (tests/serving/distilled.py).
from tests.serving.distilled import (  # noqa: E402
    bigram_target_dir as bigram_target_dir,
)
from tests.serving.distilled import (  # noqa: E402
    distilled_run as distilled_run,
)
from tests.serving.distilled import (  # noqa: E402
    distilled_server as distilled_server,
)
from tests.serving.engine import (  # noqa: E402
    gate_run as gate_run,
)
from tests.serving.engine import (  # noqa: E402
    regen_server as regen_server,
)
from tests.serving.engine import (  # noqa: E402
    scripted_target_dir as scripted_target_dir,
)
from tests.serving.engine import (  # noqa: E402
    served_target_dir as served_target_dir,
)
from tests.serving.engine import (  # noqa: E402
    vllm_python as vllm_python,
)
from tests.serving.engine import (  # noqa: E402
    vllm_server as vllm_server,
)
