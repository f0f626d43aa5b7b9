"""tools/torch_build.py and the Makefile's torch selection, on a machine without a GPU.

`nvidia-smi` is a shell script standing in for the binary (no GPU exists on CI): it prints what
a real one prints (`-L` listing, the banner with driver and CUDA version) for the driver under
test. The Makefile is checked with `make -n`, which expands the recipe without running it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import torch_build  # noqa: E402

BANNER = """Tue Dec  1 08:50:00 2026
+-----------------------------------------------------------------------------------------+
| NVIDIA-SMI {drv}              Driver Version: {drv}      CUDA Version: {cuda}     |
|-----------------------------------------+------------------------+----------------------+
|   0  NVIDIA H200                    On  |   00000000:19:00.0 Off |                    0 |
| N/A   31C    P0             77W /  700W |       0MiB / 143771MiB |      0%      Default |
+-----------------------------------------+------------------------+----------------------+
"""


def fake_smi(tmp_path: Path, drv: str = "580.95.05", cuda: str = "13.0") -> str:
    """A PATH whose nvidia-smi is the stand-in (then /usr/bin:/bin for the shell's cat)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    script = bin_dir / "nvidia-smi"
    banner = BANNER.format(drv=drv, cuda=cuda)
    script.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = "-L" ]; then\n'
        '  echo "GPU 0: NVIDIA H200 (UUID: GPU-5f0c2a51-9b3e-4c1d-8a7e-2d6b1f0e9c3a)"\n'
        "  exit 0\nfi\n"
        f"cat <<'OUT'\n{banner}OUT\n"
    )
    script.chmod(0o755)
    return f"{bin_dir}:/usr/bin:/bin"


def tool(path: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PATH": path}
    return subprocess.run(
        [sys.executable, str(ROOT / "tools" / "torch_build.py"), *args],
        capture_output=True,
        text=True,
        env=env,
    )


def test_want_follows_nvidia_smi(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    assert tool(str(empty), "want").stdout.strip() == "cpu"
    assert tool(fake_smi(tmp_path), "want").stdout.strip() == "cuda"


def test_driver_and_cuda_versions_are_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("PATH", fake_smi(tmp_path, "550.54.15", "12.4"))
    drv = torch_build.driver()
    assert drv is not None and drv.version == "550.54.15" and drv.cuda == (12, 4)
    assert drv.gpus[0].startswith("GPU 0: NVIDIA H200")


def test_the_build_of_torch() -> None:
    assert torch_build.build_of(("2.13.0+cpu", None)) == "cpu"
    assert torch_build.build_of(("2.13.0", None)) == "cpu"
    assert torch_build.build_of(("2.13.0", "13.0")) == "cuda"
    assert torch_build.build_of(None) == "none"


def test_check_fails_clearly_when_the_driver_is_too_old() -> None:
    old = torch_build.Driver("550.54.15", (12, 4), ["GPU 0: NVIDIA H200"])
    code, lines = torch_build.check(old, ("2.13.0", "13.0"))
    assert code == 1
    assert lines[0] == "driver: 550.54.15, supports CUDA 12.4, 1 GPU(s): GPU 0: NVIDIA H200"
    assert lines[1] == "torch: 2.13.0, built for CUDA 13.0"
    assert "driver 550.54.15 supports CUDA 12.4, torch needs CUDA 13.x" in lines[2]
    new = torch_build.Driver("580.95.05", (13, 0), ["GPU 0: NVIDIA H200"])
    assert torch_build.check(new, ("2.13.0", "13.0"))[0] == 0
    newer = torch_build.Driver("590.10", (13, 1), ["GPU 0: NVIDIA H200"])
    assert torch_build.check(newer, ("2.13.0", "13.0"))[0] == 0  # minor-version compatible


def test_check_on_this_venv(tmp_path: Path) -> None:
    """A GPU next to this venv's torch: a CPU build is refused, naming the fix; no GPU: fine."""
    proc = tool(fake_smi(tmp_path), "check")
    have = torch_build.build_of(torch_build.installed_torch())
    if have == "cpu":
        assert proc.returncode == 1 and "torch is a CPU build: run `make venv`" in proc.stderr
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = tool(str(empty), "check")
    assert proc.returncode == 0 and proc.stdout.startswith("driver: none")


def make_n(path_prefix: str) -> str:
    env = {**os.environ, "PATH": f"{path_prefix}:{os.environ['PATH']}"}
    proc = subprocess.run(
        ["make", "-n", "--no-print-directory", "venv"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_makefile_installs_the_pinned_cuda_build_when_a_gpu_appears(tmp_path: Path) -> None:
    """With a GPU the stamp is a new one (so an existing CPU venv is redone), the CPU build is
    uninstalled, and the same torch version's CUDA wheel goes in with its own triton pin."""
    out = make_n(fake_smi(tmp_path))
    assert "pip uninstall -q -y torch triton" in out
    assert "pip install -q torch===2.13.0 triton==3.7.1" in out
    assert "tools/torch_build.py check || exit 1" in out
    assert "tools/torch_build.py constraints cuda requirements.lock" in out
    assert "constraints-cuda.txt" in out
    assert "-cuda\n" in out.splitlines(keepends=True)[-1]


def test_makefile_without_a_gpu_keeps_the_cpu_build() -> None:
    if torch_build.driver() is not None:
        pytest.skip("this machine has a GPU")
    out = make_n("/nonexistent")
    # up to date: nothing to do; a fresh venv: the recipe runs its CPU branch, CPU stamp
    assert all("-cuda" not in line for line in out.splitlines() if line.startswith("touch"))
    assert "Nothing to be done" in out or 'if [ "cpu" = cuda ]' in out


def test_the_pins_have_one_home_and_the_cuda_constraints_swap_triton(tmp_path: Path) -> None:
    """The Makefile's torch and triton come from tools/torch_build.py (dflashctl setup runs the
    same file in the container): the recipe names exactly what the module says."""
    out = make_n(fake_smi(tmp_path))
    cuda = torch_build.requirement("cuda")
    assert cuda == f"torch==={torch_build.TORCH_VERSION}"
    assert f"pip install -q {cuda} triton=={torch_build.TRITON_CUDA}" in out
    assert torch_build.requirement("cpu") == f"torch=={torch_build.TORCH_VERSION}"
    lock = "numpy==2.3.4\ntriton==3.9.0\n"
    assert torch_build.constraints(lock, "cpu") == lock
    assert (
        torch_build.constraints(lock, "cuda")
        == f"numpy==2.3.4\ntriton=={torch_build.TRITON_CUDA}\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "torch_build.py"),
            "constraints",
            "cuda",
            str(ROOT / "requirements.lock"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert f"triton=={torch_build.TRITON_CUDA}" in done.stdout.splitlines()
