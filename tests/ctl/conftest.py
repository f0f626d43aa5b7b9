"""Session-scoped real parts for dflashctl tests: one sshd, one LXC container, reused."""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashctl.config.inventory import HostConfig, load_inventory
from dflashctl.releases.release import Release, build_release
from tests.conftest import require_part
from tests.ctl import parts as P

STANDIN = Path(__file__).resolve().parent / "standin"


@pytest.fixture(scope="session")
def real_parts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[P.Parts]:
    """sshd on loopback + a running LXC container + pct shim (fails under CI if unavailable)."""
    missing = P.have("/usr/sbin/sshd", "ssh-keygen", "lxc-create", "lxc-attach", "tmux")
    require_part(missing is None, missing or "")
    require_part(os.geteuid() == 0, "LXC containers need root")
    base = tmp_path_factory.mktemp("parts")
    stack = contextlib.ExitStack()
    try:
        got = stack.enter_context(P.real_parts(base))
    except (RuntimeError, OSError) as err:
        stack.close()
        require_part(False, f"real parts did not start: {err}")
        raise  # unreachable: require_part skipped or failed
    with stack:
        yield got


@pytest.fixture(scope="session")
def standin_release() -> Release:
    return build_release(STANDIN)


@pytest.fixture(scope="session")
def ssh_host(real_parts: P.Parts, tmp_path_factory: pytest.TempPathFactory) -> HostConfig:
    """The container as an inventory host, its key already pinned (trust is tested separately)."""
    d = tmp_path_factory.mktemp("inv")
    known = d / "known_hosts"
    pub = real_parts.sshd.host_pub.read_text().split()
    known.write_text(f"[127.0.0.1]:{real_parts.sshd.port} {pub[0]} {pub[1]}\n")
    inv = d / "hosts.toml"
    inv.write_text(P.hosts_toml(real_parts, known_hosts=known))
    return load_inventory(inv).get("ct")


@pytest.fixture
def clean_workdir(real_parts: P.Parts) -> Iterator[Path]:
    """Empty container workdir and no tmux server before and after a test."""

    def wipe() -> None:
        P.kill_tmux_in(real_parts.container)
        for child in real_parts.container.workdir_host.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    wipe()
    yield real_parts.container.workdir_host
    wipe()
