"""Import boundaries from ../shared/ARCHITECTURE.md, checked in fresh interpreters.

- dflashctl works on a laptop without the training stack: every dflashctl module (TUI included)
  and the trainer modules it reaches import with torch, triton, transformers and the trackers
  (tensorboard, wandb) unimportable, and
  `dflashctl --help` runs.
- Textual is imported only under dflashctl/tui/: every other dflashctl module (services, CLI,
  monitor, demo) imports with textual unimportable.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import dflashctl

REPO = Path(__file__).resolve().parents[1]

TRAINING_STACK = ("torch", "triton", "transformers", "tensorboard", "wandb")


def _blocker(roots: tuple[str, ...]) -> str:
    return f"""
import importlib.abc, sys
class _Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {set(roots)!r}:
            raise ImportError(f"{{name}} is blocked by an import-boundary test")
        return None
sys.meta_path.insert(0, _Blocked())
"""


def _dflashctl_modules() -> list[str]:
    names = ["dflashctl"]
    for info in pkgutil.walk_packages(dflashctl.__path__, prefix="dflashctl."):
        names.append(info.name)
    return names


def _run(code: str, blocked: tuple[str, ...] = TRAINING_STACK) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _blocker(blocked) + code],
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
            f"blocked = sorted(m for m in sys.modules if m.split('.')[0] in {set(TRAINING_STACK)!r})\n"
            "assert not blocked, blocked\n"
            "print(len(sys.modules))\n"
        )
    )
    out = _run(code)
    assert out.returncode == 0, out.stderr[-2000:]


def test_textual_stays_under_dflashctl_tui() -> None:
    modules = [m for m in _dflashctl_modules() if not m.startswith("dflashctl.tui")]
    assert {"dflashctl.monitor", "dflashctl.demo", "dflashctl.control"} <= set(modules)
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "assert not [m for m in sys.modules if m.split('.')[0] == 'textual']\n"
    out = _run(code, blocked=("textual",))
    assert out.returncode == 0, out.stderr[-2000:]


def test_dflashctl_help_runs_without_torch() -> None:
    out = _run(
        "import sys; sys.argv = ['dflashctl', '--help']\nfrom dflashctl.cli import main\nmain()"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for command in ("deploy", "restart", "status", "logs", "demo"):
        assert command in out.stdout
