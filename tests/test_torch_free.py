"""dflashctl must work on a laptop without the training stack.

Every dflashctl module (TUI included) and the trainer modules it reaches are imported in a fresh
interpreter where torch, triton and transformers cannot be imported; `dflashctl --help` must run.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import dflashctl

REPO = Path(__file__).resolve().parents[1]

BLOCKER = """
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {"torch", "triton", "transformers"}:
            raise ImportError(f"{name} is blocked: dflashctl must stay torch-free")
        return None
sys.meta_path.insert(0, _Blocked())
"""


def _dflashctl_modules() -> list[str]:
    names = ["dflashctl"]
    for info in pkgutil.walk_packages(dflashctl.__path__, prefix="dflashctl."):
        names.append(info.name)
    return names


def _run(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + code, *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )


def test_every_dflashctl_module_imports_without_torch() -> None:
    modules = _dflashctl_modules()
    assert "dflashctl.tui.app" in modules and "dflashctl.cli" in modules
    code = (
        "import importlib\n"
        + "".join(f"importlib.import_module({m!r})\n" for m in modules)
        + (
            "blocked = sorted(m for m in sys.modules if m.split('.')[0] in {'torch', 'triton', 'transformers'})\n"
            "assert not blocked, blocked\n"
            "print(len(sys.modules))\n"
        )
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]


def test_dflashctl_help_runs_without_torch() -> None:
    out = _run(
        "import sys; sys.argv = ['dflashctl', '--help']\nfrom dflashctl.cli import main\nmain()"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for command in ("deploy", "restart", "status", "logs", "demo"):
        assert command in out.stdout
