"""Import boundaries from docs/design.md ("Layers"), checked from the source and in fresh
interpreters.

- dflashctl imports exactly three contract modules of the trainer: `trainer.events`,
  `trainer.config` and `trainer.buckets` (and their submodules); every import statement in
  every dflashctl file counts, function-local ones included.
- No import cycle among the modules of `trainer/` and `dflashctl/` (function-local imports
  count; imports under `if TYPE_CHECKING:` do not, they never run).
- dflashctl works on a laptop without the training stack: every dflashctl module (TUI included)
  and the trainer modules it reaches import with torch, triton, transformers and the trackers
  (tensorboard, wandb) unimportable, and `dflashctl --help` runs.
- Textual is imported only under dflashctl/tui/: every other dflashctl module (services, CLI,
  monitor, demo) imports with textual unimportable.
- dflashctl's folders are its layers (docs/design.md, "dflashctl, top to bottom"): every module
  belongs to exactly one layer of `DFLASHCTL_LAYERS`, and every import (function-local and
  TYPE_CHECKING ones included) points to its own layer or one below. asyncssh is imported only
  under dflashctl/remote/ssh/.
"""

from __future__ import annotations

import ast
import pkgutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

import dflashctl
from tests import budget

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("trainer", "dflashctl")  # the tree whose module graph must have no cycle
# What dflashctl may import of the trainer: the torch-free contract modules.
TRAINER_CONTRACTS = ("trainer.events", "trainer.config", "trainer.buckets")

TRAINING_STACK = ("torch", "triton", "transformers", "tensorboard", "wandb")

# dflashctl's layers, top to bottom: a module may import its own layer and the ones below it.
DFLASHCTL_LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("command line", ("dflashctl.cli", "dflashctl.__main__")),
    ("demo", ("dflashctl.demo",)),
    ("tui", ("dflashctl.tui",)),
    ("groups", ("dflashctl.groups",)),
    ("fleet", ("dflashctl.fleet",)),
    ("monitor", ("dflashctl.monitor",)),
    ("alerts", ("dflashctl.alerts",)),
    ("jobs", ("dflashctl.jobs",)),
    ("compare", ("dflashctl.compare",)),
    ("runs", ("dflashctl.runs",)),
    ("doctor", ("dflashctl.doctor",)),
    ("releases", ("dflashctl.releases",)),
    ("gpus", ("dflashctl.gpus",)),
    ("remote", ("dflashctl.remote",)),
    ("config", ("dflashctl.config",)),
    ("base", ("dflashctl.errors", "dflashctl.humanize")),
)
SSH_PACKAGE = "dflashctl.remote.ssh"


# --------------------------------------------------------------------------- the module graph


@dataclass(frozen=True)
class Edge:
    """One import statement: ``source`` imports ``target`` at ``path:line``."""

    source: str
    target: str
    path: str  # relative to the root, with '/'
    line: int
    type_checking: bool  # under `if TYPE_CHECKING:` (never runs)

    def where(self) -> str:
        return f"{self.path}:{self.line}"


def module_files(root: Path, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Module name -> file, for every .py file under the packages (a package is its __init__)."""
    modules: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.Module) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
    """Every import statement anywhere in the file (functions, classes, try/if bodies), with
    whether it sits under `if TYPE_CHECKING:`."""

    def walk(node: ast.AST, guarded: bool) -> Iterator[tuple[ast.Import | ast.ImportFrom, bool]]:
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node, guarded
            return
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for stmt in node.body:
                yield from walk(stmt, True)
            for stmt in node.orelse:
                yield from walk(stmt, guarded)
            return
        for child in ast.iter_child_nodes(node):
            yield from walk(child, guarded)

    yield from walk(tree, False)


def _targets(
    node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]
) -> list[str]:
    """The modules an import statement names: `from a import b` names `a.b` when that is a
    module of the tree, else `a`; a relative import is resolved against ``module``."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if is_package else module.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    out = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        out.append(sub if sub in known else base)
    return out


def import_edges(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[Edge]:
    """Every import statement of every module of the packages under ``root``."""
    files = module_files(root, packages)
    known = set(files)
    edges = []
    for module, path in files.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        rel = path.relative_to(root).as_posix()
        for node, guarded in _imports(tree):
            for target in _targets(node, module, path.name == "__init__.py", known):
                edges.append(Edge(module, target, rel, node.lineno, guarded))
    return edges


def _in(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def wrong_trainer_edges(edges: list[Edge]) -> list[Edge]:
    """dflashctl's imports of the trainer outside the contract modules."""
    return [
        e
        for e in edges
        if _in(e.source, ("dflashctl",))
        and _in(e.target, ("trainer",))
        and not _in(e.target, TRAINER_CONTRACTS)
    ]


def layer_of(module: str, layers: tuple[tuple[str, tuple[str, ...]], ...]) -> int | None:
    """The index of the layer holding `module` (0 = top), None when no layer names it."""
    for i, (_, prefixes) in enumerate(layers):
        if _in(module, prefixes):
            return i
    return None


def unplaced_modules(
    modules: list[str], layers: tuple[tuple[str, tuple[str, ...]], ...] = DFLASHCTL_LAYERS
) -> list[str]:
    """dflashctl modules that belong to no layer (the package itself excepted)."""
    return [
        m
        for m in modules
        if _in(m, ("dflashctl",)) and m != "dflashctl" and layer_of(m, layers) is None
    ]


def upward_edges(
    edges: list[Edge], layers: tuple[tuple[str, tuple[str, ...]], ...] = DFLASHCTL_LAYERS
) -> list[str]:
    """Imports from a dflashctl layer to one above it, as `file:line: a (layer) imports b
    (layer)`; TYPE_CHECKING imports count (a type-only import upward is a dependency too)."""
    out = []
    for e in edges:
        src, dst = layer_of(e.source, layers), layer_of(e.target, layers)
        if src is not None and dst is not None and dst < src:
            out.append(
                f"{e.where()}: {e.source} ({layers[src][0]}) imports {e.target} ({layers[dst][0]})"
            )
    return out


def ssh_outside_its_package(edges: list[Edge]) -> list[Edge]:
    """asyncssh imported anywhere in dflashctl outside dflashctl/remote/ssh/."""
    return [
        e
        for e in edges
        if _in(e.target, ("asyncssh",))
        and _in(e.source, ("dflashctl",))
        and not _in(e.source, (SSH_PACKAGE,))
    ]


def import_cycles(edges: list[Edge]) -> list[list[Edge]]:
    """One cycle (as its edges, in order) per strongly connected group of modules; imports
    under `if TYPE_CHECKING:` and of modules outside the tree are left out."""
    modules = {e.source for e in edges}
    graph: dict[str, dict[str, Edge]] = {m: {} for m in modules}
    for e in edges:
        if not e.type_checking and e.target in modules and e.target != e.source:
            graph[e.source].setdefault(e.target, e)
    # Tarjan's strongly connected components, iteratively (no recursion limit on a big tree).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    groups.append(sorted(group))
    return [_cycle_in(group, graph) for group in groups]


def _cycle_in(group: list[str], graph: dict[str, dict[str, Edge]]) -> list[Edge]:
    """A shortest cycle through the group's first module (breadth-first, inside the group)."""
    members = set(group)
    start = group[0]
    came_by: dict[str, Edge] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for node in frontier:
            for target, edge in sorted(graph[node].items()):
                if target == start:
                    path = [edge]
                    while path[0].source != start:
                        path.insert(0, came_by[path[0].source])
                    return path
                if target in members and target not in came_by:
                    came_by[target] = edge
                    nxt.append(target)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {group}")  # Tarjan said there is one


def describe_cycle(cycle: list[Edge]) -> str:
    return " -> ".join([cycle[0].source, *(f"{e.target} ({e.where()})" for e in cycle)])


@pytest.fixture(scope="module")
def edges() -> list[Edge]:
    return import_edges(REPO)


def test_the_graph_sees_function_local_and_relative_imports(edges: list[Edge]) -> None:
    """The scan is not vacuous: it finds dflashctl's contract imports, local ones included."""
    targets = {(e.source, e.target) for e in edges}
    assert ("dflashctl.monitor.state", "trainer.events") in targets
    assert ("trainer.events.run_state", "trainer.events.evaluation") in targets
    assert any(_in(e.source, ("dflashctl.cli",)) and e.target.startswith("trainer.") for e in edges)
    assert ("dflashctl.remote.ssh.transport", "asyncssh") in targets


def test_dflashctl_imports_only_the_trainer_contract_modules(edges: list[Edge]) -> None:
    wrong = wrong_trainer_edges(edges)
    assert not wrong, (
        "dflashctl may import only "
        + ", ".join(TRAINER_CONTRACTS)
        + ":\n"
        + ("\n".join(f"{e.where()}: imports {e.target}" for e in wrong))
    )


def test_every_dflashctl_module_is_in_a_layer(edges: list[Edge]) -> None:
    modules = sorted(module_files(REPO, ("dflashctl",)))
    assert "dflashctl.runs.control" in modules and "dflashctl.gpus.reader" in modules
    assert not unplaced_modules(modules), (
        "dflashctl modules outside every layer of DFLASHCTL_LAYERS (place the new folder "
        "there and in docs/design.md): " + ", ".join(unplaced_modules(modules))
    )


def test_dflashctl_layers_only_import_downwards(edges: list[Edge]) -> None:
    wrong = upward_edges(edges)
    assert not wrong, "imports against the layer order:\n" + "\n".join(wrong)


def test_asyncssh_only_under_remote_ssh(edges: list[Edge]) -> None:
    wrong = ssh_outside_its_package(edges)
    assert not wrong, "\n".join(f"{e.where()}: imports {e.target}" for e in wrong)


def test_a_planted_upward_import_and_a_stray_module_are_named(tmp_path: Path) -> None:
    """The layer checks fire on a tree that breaks them, naming file:line and both layers."""
    _write(
        tmp_path,
        {
            "dflashctl/__init__.py": "",
            "dflashctl/runs/__init__.py": "",
            "dflashctl/runs/control.py": (
                "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                "    from dflashctl.fleet import HostHandle\n"
            ),
            "dflashctl/fleet.py": "from dflashctl.runs import control\n",
            "dflashctl/remote/__init__.py": "",
            "dflashctl/remote/connect.py": "import asyncssh\n",
            "dflashctl/remote/ssh/__init__.py": "import asyncssh\n",
            "dflashctl/stray.py": "",
        },
    )
    planted = import_edges(tmp_path, ("dflashctl",))
    assert upward_edges(planted) == [
        "dflashctl/runs/control.py:3: dflashctl.runs.control (runs) imports dflashctl.fleet (fleet)"
    ]
    assert unplaced_modules(sorted(module_files(tmp_path, ("dflashctl",)))) == ["dflashctl.stray"]
    assert [e.where() for e in ssh_outside_its_package(planted)] == [
        "dflashctl/remote/connect.py:1"
    ]


def test_no_import_cycle_in_the_tree(edges: list[Edge]) -> None:
    cycles = import_cycles(edges)
    assert not cycles, "import cycles:\n" + "\n".join(describe_cycle(c) for c in cycles)


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_planted_wrong_edge_and_cycle_are_named(tmp_path: Path) -> None:
    """Both checks fail on a tree with a wrong edge and a cycle, naming file:line."""
    _write(
        tmp_path,
        {
            "trainer/__init__.py": "",
            "trainer/events/__init__.py": "",
            "trainer/events/status.py": "",
            "trainer/config/__init__.py": "",
            "trainer/pipeline/__init__.py": "",
            "trainer/pipeline/loop.py": "from trainer.events import status\n",
            "dflashctl/__init__.py": "",
            "dflashctl/good.py": (
                "from trainer import events\nfrom trainer.events.status import X\n"
                "import trainer.config\n"
            ),
            "dflashctl/bad.py": (
                "import trainer\n\n\ndef f():\n    from trainer.pipeline import loop\n"
            ),
            # a cycle through a relative and a function-local import
            "dflashctl/a.py": "from . import b\n",
            "dflashctl/b.py": "def g():\n    from dflashctl import a\n",
            # a cycle only under TYPE_CHECKING does not count
            "dflashctl/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
            "    from dflashctl import d\n",
            "dflashctl/d.py": "import dflashctl.c\n",
        },
    )
    planted = import_edges(tmp_path)
    wrong = sorted((e.where(), e.target) for e in wrong_trainer_edges(planted))
    assert wrong == [
        ("dflashctl/bad.py:1", "trainer"),
        ("dflashctl/bad.py:5", "trainer.pipeline.loop"),
    ]
    cycles = import_cycles(planted)
    assert [describe_cycle(c) for c in cycles] == [
        "dflashctl.a -> dflashctl.b (dflashctl/a.py:1) -> dflashctl.a (dflashctl/b.py:2)"
    ]


# --------------------------------------------------------------------------- fresh interpreters


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
        if not info.name.endswith(".__main__"):  # a script: importing it runs the command
            names.append(info.name)
    return names


def _run(code: str, blocked: tuple[str, ...] = TRAINING_STACK) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", _blocker(blocked) + code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=budget.left(),
    )


def test_every_dflashctl_module_imports_without_torch() -> None:
    modules = _dflashctl_modules()
    assert "dflashctl.tui.app" in modules and "dflashctl.cli.main" in modules
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
    assert {"dflashctl.monitor.state", "dflashctl.demo", "dflashctl.runs.control"} <= set(modules)
    code = "import importlib\n" + "".join(f"importlib.import_module({m!r})\n" for m in modules)
    code += "assert not [m for m in sys.modules if m.split('.')[0] == 'textual']\n"
    out = _run(code, blocked=("textual",))
    assert out.returncode == 0, out.stderr[-2000:]


def test_dflashctl_help_runs_without_torch() -> None:
    out = _run(
        "import sys; sys.argv = ['dflashctl', '--help']\nfrom dflashctl.cli.main import main\nmain()"
    )
    assert out.returncode == 0, out.stderr[-2000:]
    for command in ("deploy", "restart", "status", "logs", "demo"):
        assert command in out.stdout
