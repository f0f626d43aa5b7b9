"""Which torch build this machine needs, which one the venv has, and whether the driver can run it.

Used by the Makefile (stdlib only: it runs before torch is installed) and as a preflight:

    python tools/torch_build.py want      # "cuda" when nvidia-smi lists a GPU, else "cpu"
    python tools/torch_build.py have      # "cuda", "cpu" (a +cpu build or torch.version.cuda
                                          #   is None) or "none" (torch not importable)
    python tools/torch_build.py check     # driver, its CUDA, torch and its CUDA, one line each;
                                          #   exit 1 with one line when they cannot work together
    python tools/torch_build.py version   # the tested torch version (TORCH_VERSION)
    python tools/torch_build.py triton-cuda        # the CUDA wheel's triton pin (TRITON_CUDA)
    python tools/torch_build.py requirement cpu|cuda   # the pip requirement for that build
    python tools/torch_build.py constraints cpu|cuda LOCK  # LOCK with the build's triton line

The one place the torch build is decided: the Makefile reads its pins from here, and
`dflashctl setup` ships this file into the container and runs the same `want`, `requirement`
and `constraints` there.

The CUDA build the Makefile installs is torch 2.13.0's default Linux wheel on PyPI, built for
CUDA 13.0 (its metadata requires cuda-toolkit 13.0.3 and triton 3.7.1): a driver whose
`nvidia-smi` reports a CUDA version below 13.0 (driver < 580) cannot run it.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from dataclasses import dataclass

TORCH_VERSION = "2.13.0"  # the tested version, both builds
TRITON_CUDA = "3.7.1"  # the triton torch 2.13.0's CUDA wheel requires (the lock pins the CPU one's)
WHEEL_CUDA = (13, 0)  # CUDA of torch 2.13.0's PyPI wheel


@dataclass(frozen=True)
class Driver:
    version: str  # e.g. "580.95.05"
    cuda: tuple[int, int]  # the newest CUDA this driver supports, from nvidia-smi's banner
    gpus: list[str]


def _smi(*args: str) -> str | None:
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return None
    try:
        proc = subprocess.run([exe, *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return proc.stdout if proc.returncode == 0 else None


def driver() -> Driver | None:
    """The driver as nvidia-smi reports it, or None without a working nvidia-smi or GPU."""
    listing = _smi("-L")
    gpus = [line for line in (listing or "").splitlines() if line.startswith("GPU ")]
    if not gpus:
        return None
    banner = _smi() or ""
    ver = re.search(r"Driver Version:\s*([0-9.]+)", banner)
    cuda = re.search(r"CUDA Version:\s*([0-9]+)\.([0-9]+)", banner)
    if not ver or not cuda:
        return Driver(ver.group(1) if ver else "unknown", (0, 0), gpus)
    return Driver(ver.group(1), (int(cuda.group(1)), int(cuda.group(2))), gpus)


def installed_torch() -> tuple[str, str | None] | None:
    """(torch.__version__, torch.version.cuda) of the running interpreter, None without torch."""
    try:
        import torch
    except ImportError:
        return None
    return str(torch.__version__), torch.version.cuda


def build_of(torch_info: tuple[str, str | None] | None) -> str:
    if torch_info is None:
        return "none"
    version, cuda = torch_info
    return "cpu" if "+cpu" in version or cuda is None else "cuda"


def check(drv: Driver | None, torch_info: tuple[str, str | None] | None) -> tuple[int, list[str]]:
    """Exit code and report lines: 1 when a GPU is present but cannot be used by this torch."""
    lines: list[str] = []
    if drv is None:
        lines.append("driver: none (no GPU listed by nvidia-smi)")
    else:
        lines.append(
            f"driver: {drv.version}, supports CUDA {drv.cuda[0]}.{drv.cuda[1]}, "
            f"{len(drv.gpus)} GPU(s): {drv.gpus[0]}"
        )
    if torch_info is None:
        lines.append("torch: not installed")
    else:
        lines.append(f"torch: {torch_info[0]}, built for CUDA {torch_info[1] or 'none (CPU)'}")
    if drv is None:
        return 0, lines
    build = build_of(torch_info)
    if build == "cpu":
        lines.append(
            "error: a GPU is present but torch is a CPU build: run `make venv` to replace it"
        )
        return 1, lines
    need = WHEEL_CUDA
    if build == "cuda" and torch_info and torch_info[1]:
        m = re.match(r"([0-9]+)\.([0-9]+)", torch_info[1])
        need = (int(m.group(1)), int(m.group(2))) if m else need
    if drv.cuda < (need[0], 0):
        lines.append(
            f"error: driver {drv.version} supports CUDA {drv.cuda[0]}.{drv.cuda[1]}, torch needs "
            f"CUDA {need[0]}.x (driver >= 580 for CUDA 13): upgrade the driver or install a torch "
            "built for an older CUDA"
        )
        return 1, lines
    return 0, lines


def requirement(build: str) -> str:
    """`==` for the CPU build; `===` for CUDA, because `==X` also matches a local X+cpu wheel
    (and pip prefers it)."""
    return f"torch=={TORCH_VERSION}" if build == "cpu" else f"torch==={TORCH_VERSION}"


def constraints(lock: str, build: str) -> str:
    """The lock as pip constraints for `build`: the CUDA wheel needs its own triton."""
    if build == "cpu":
        return lock
    return re.sub(r"(?m)^triton==.*$", f"triton=={TRITON_CUDA}", lock)


def main(argv: list[str]) -> int:
    cmd = argv[0] if argv else "check"
    if cmd == "version":
        print(TORCH_VERSION)
        return 0
    if cmd == "triton-cuda":
        print(TRITON_CUDA)
        return 0
    if cmd == "requirement" and len(argv) == 2 and argv[1] in ("cpu", "cuda"):
        print(requirement(argv[1]))
        return 0
    if cmd == "constraints" and len(argv) == 3 and argv[1] in ("cpu", "cuda"):
        with open(argv[2], encoding="utf-8") as fh:
            sys.stdout.write(constraints(fh.read(), argv[1]))
        return 0
    if cmd == "want":
        print("cuda" if driver() is not None else "cpu")
        return 0
    if cmd == "have":
        print(build_of(installed_torch()))
        return 0
    if cmd == "check":
        code, lines = check(driver(), installed_torch())
        print("\n".join(lines), file=sys.stderr if code else sys.stdout)
        return code
    print(
        f"usage: {sys.argv[0]} want|have|check|version|triton-cuda|requirement BUILD|"
        f"constraints BUILD LOCK (got {' '.join(argv)!r})",
        file=sys.stderr,
    )
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
