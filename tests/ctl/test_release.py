"""Content-addressed releases: same tree -> same id and bytes; caches ignored; any change shows."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from dflashctl.releases.release import VERIFY_SCRIPT, ReleaseError, build_release, tree_hash


def make_tree(root: Path) -> Path:
    (root / "trainer" / "sub").mkdir(parents=True)
    (root / "trainer" / "__init__.py").write_text("x = 1\n")
    (root / "trainer" / "sub" / "m.py").write_text("y = 2\n")
    return root


def test_same_tree_same_id_and_bytes(tmp_path: Path) -> None:
    a = build_release(make_tree(tmp_path / "a"))
    b = build_release(make_tree(tmp_path / "b"))
    assert a.id == b.id and a.tar == b.tar and a.files == 2 and len(a.id) == 12


def test_caches_are_ignored(tmp_path: Path) -> None:
    root = make_tree(tmp_path)
    before = tree_hash(root)
    (root / "trainer" / "__pycache__").mkdir()
    (root / "trainer" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (root / "trainer" / "sub" / "m.pyc").write_bytes(b"\0")
    assert tree_hash(root) == before
    with tarfile.open(fileobj=io.BytesIO(build_release(root).tar)) as tar:
        assert all("__pycache__" not in n for n in tar.getnames())


@pytest.mark.parametrize("change", ["content", "rename", "exec-bit", "new-file"])
def test_any_real_change_changes_the_id(tmp_path: Path, change: str) -> None:
    root = make_tree(tmp_path)
    before = tree_hash(root)
    f = root / "trainer" / "sub" / "m.py"
    if change == "content":
        f.write_text("y = 3\n")
    elif change == "rename":
        f.rename(f.with_name("n.py"))
    elif change == "exec-bit":
        f.chmod(0o755)
    else:
        (root / "trainer" / "new.py").write_text("")
    assert tree_hash(root) != before


def test_hostile_filenames_survive_tar_and_remote_verification(tmp_path: Path) -> None:
    root = make_tree(tmp_path / "src")
    hostile = ["a b.py", "$(touch pwned).py", "semi;colon.py", "quote'd\".py", "star*.txt", "-rf"]
    for name in hostile:
        (root / "trainer" / name).write_text(name)
    rel = build_release(root)
    out = tmp_path / "out"
    out.mkdir()
    subprocess.run(["tar", "-x", "-f", "-", "-C", str(out)], input=rel.tar, check=True)
    assert sorted(p.name for p in (out / "trainer").iterdir() if p.is_file()) == sorted(
        ["__init__.py", *hostile]
    )
    got = subprocess.run(
        [sys.executable, "-c", VERIFY_SCRIPT, str(out), "trainer"], capture_output=True, text=True
    ).stdout.strip()
    assert got == rel.id
    assert not (tmp_path / "pwned").exists() and not Path("pwned").exists()


def test_missing_tree_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ReleaseError, match=r"trainer package not found"):
        build_release(tmp_path)
