"""Content-addressed releases of the trainer package.

The release id is a hash of what would run: sorted relative paths, the executable bit and the
bytes of every file, skipping caches. The same tree always yields the same id and the same tar
bytes (fixed mtimes, owners, modes), so a redeploy of an unchanged tree is recognised remotely
without sending anything. The hashing code is a source string so the container can run the very
same algorithm to verify what it unpacked.
"""

from __future__ import annotations

import importlib.util
import io
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from dflashctl.errors import UsageError

HASH_LEN = 12

# Executed here (to define tree_hash) and sent verbatim to the container's python for
# verification: one algorithm, no drift. stdlib only.
TREE_HASH_SOURCE = r'''
import hashlib, os, stat

SKIP_DIRS = {"__pycache__", ".git", ".mypy_cache", ".pytest_cache", ".ruff_cache"}
SKIP_SUFFIXES = (".pyc", ".pyo", ".swp", "~")


def tree_files(root, prefix):
    """Sorted (relative path, absolute path) of files to ship under root/prefix."""
    out = []
    base = os.path.join(root, prefix)
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS and not d.startswith(".tmp"))
        for name in filenames:
            if name.endswith(SKIP_SUFFIXES) or name == ".complete":
                continue
            full = os.path.join(dirpath, name)
            if not os.path.isfile(full) or os.path.islink(full):
                continue
            out.append((os.path.relpath(full, root).replace(os.sep, "/"), full))
    return sorted(out)


def tree_hash(root, prefix="trainer"):
    h = hashlib.sha256()
    for rel, full in tree_files(root, prefix):
        st = os.stat(full)
        executable = "x" if st.st_mode & stat.S_IXUSR else "-"
        with open(full, "rb") as f:
            data = f.read()
        h.update(f"{rel}\0{executable}\0{len(data)}\0".encode())
        h.update(data)
    return h.hexdigest()[:12]
'''

_ns: dict[str, object] = {}
exec(compile(TREE_HASH_SOURCE, "dflashctl.releases.release.TREE_HASH_SOURCE", "exec"), _ns)
_tree_files = cast(Callable[[str, str], list[tuple[str, str]]], _ns["tree_files"])
_tree_hash = cast(Callable[[str, str], str], _ns["tree_hash"])

VERIFY_SCRIPT = TREE_HASH_SOURCE + "\nimport sys\nprint(tree_hash(sys.argv[1], sys.argv[2]))\n"


class ReleaseError(UsageError):
    """The tree to ship is missing or unreadable (names the path): exit 2, the user's input."""


@dataclass(frozen=True)
class Release:
    """A packaged trainer tree: its id and the deterministic tar stream to ship."""

    id: str
    tar: bytes
    files: int


def tree_hash(root: Path, prefix: str = "trainer") -> str:
    return str(_tree_hash(str(root), prefix))


def package_root() -> Path:
    """The directory that contains the `trainer` package this dflashctl ships.

    Found, not imported: dflashctl imports only trainer's contract modules (events, config,
    buckets), and importing the package would run its `__init__`."""
    spec = importlib.util.find_spec("trainer")
    if spec is None or spec.origin is None:
        raise ReleaseError("trainer package not found (is it installed next to dflashctl?)")
    return Path(spec.origin).resolve().parent.parent


def build_release(root: Path | None = None, prefix: str = "trainer") -> Release:
    """Hash and tar `root/prefix` (default: the installed trainer package)."""
    root = root or package_root()
    if not (root / prefix).is_dir():
        raise ReleaseError(f"{root / prefix}: trainer package not found")
    files = _tree_files(str(root), prefix)
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for rel, full in files:
            path = Path(full)
            info = tarfile.TarInfo(rel)
            info.size = path.stat().st_size
            info.mode = 0o755 if path.stat().st_mode & 0o100 else 0o644
            info.mtime = 0
            info.uid = info.gid = 0
            info.uname = info.gname = "root"
            with path.open("rb") as f:
                tar.addfile(info, f)
    return Release(id=tree_hash(root, prefix), tar=buf.getvalue(), files=len(files))
