"""`dflashctl setup`: the trainer's environment in the container, from the checkout's lock.

What goes over: `requirements.lock`, `tools/torch_build.py` (the torch rule the Makefile uses,
run in the container against its own nvidia-smi) and the `train` extra of pyproject.toml, all
from the checkout that holds the trainer this dflashctl deploys (`release.package_root`).
The container's script (`dflashctl.remote.setup_script`) builds WORKDIR/envs/<key> and links
WORKDIR/env to it; `python` in hosts.toml defaults to WORKDIR/env/bin/python. `--wheelhouse
DIR` pushes DIR's wheels (only those not there yet) to WORKDIR/wheelhouse and installs from them
with no package index, for containers without package access.
"""

from __future__ import annotations

import hashlib
import io
import json
import re
import tarfile
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import DflashctlError, ExitCode, UsageError
from dflashctl.releases.release import package_root
from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.setup_script import (
    SETUP_ENV,
    env_info_argv,
    setup_argv,
    spec_dir,
    unpack_argv,
    wheel_list_argv,
    wheel_unpack_argv,
)
from dflashctl.remote.transport import Transport

Progress = Callable[[str], None]
MIB = 1024**2


class SetupError(DflashctlError):
    """The environment could not be built (the previous one is kept)."""

    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class EnvSpec:
    lock: str
    rule: str  # tools/torch_build.py
    requirements: tuple[str, ...]

    @property
    def lock_sha(self) -> str:
        return hashlib.sha256(self.lock.encode()).hexdigest()[:12]

    @property
    def digest(self) -> str:
        h = hashlib.sha256()
        for part in (self.lock, self.rule, "\n".join(self.requirements), SETUP_ENV):
            h.update(part.encode() + b"\0")
        return h.hexdigest()[:12]

    def tar(self) -> bytes:
        files = {
            "requirements.lock": self.lock,
            "torch_build.py": self.rule,
            "requirements.txt": "\n".join(self.requirements) + "\n",
            "setup_env.py": SETUP_ENV,
        }
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tar:
            for name, text in sorted(files.items()):
                data = text.encode()
                info = tarfile.TarInfo(name)
                info.size, info.mode = len(data), 0o644
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()


def train_requirements(pyproject: Path) -> tuple[str, ...]:
    """The `train` extra minus torch (its build is torch_build's choice)."""
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]["train"]
    return tuple(r for r in extras if not re.match(r"torch\b", r))


def env_spec(root: Path | None = None) -> EnvSpec:
    """The spec from the checkout that holds the trainer (`root`, default: package_root())."""
    root = root or package_root()
    files = [root / "requirements.lock", root / "tools" / "torch_build.py", root / "pyproject.toml"]
    for f in files:
        if not f.is_file():
            raise UsageError(
                f"{f}: not found; dflashctl setup builds the container's env from the checkout "
                f"that holds the trainer ({root})"
            )
    return EnvSpec(files[0].read_text(), files[1].read_text(), train_requirements(files[2]))


async def push_wheelhouse(
    transport: Transport, host: HostConfig, wheelhouse: Path, progress: Progress
) -> str:
    """Copy DIR's wheels the container lacks to WORKDIR/wheelhouse; returns that path."""
    if not wheelhouse.is_dir():
        raise UsageError(f"--wheelhouse {wheelhouse}: not a directory")
    wheels = sorted(wheelhouse.glob("*.whl"))
    if not wheels:
        raise UsageError(f"--wheelhouse {wheelhouse}: no .whl files in it")
    dest = RemoteLayout(host.workdir).path("wheelhouse")
    res = await transport.run(wheel_list_argv(dest))
    there = {}
    for line in res.stdout.splitlines():
        size, _, name = line.partition(" ")
        if size.isdigit():
            there[name] = int(size)
    send = [w for w in wheels if there.get(w.name) != w.stat().st_size]
    if not send:
        progress(f"{host.name}: setup: all {len(wheels)} wheels already in {dest}")
        return dest
    total = sum(w.stat().st_size for w in send)
    progress(f"{host.name}: setup: pushing {len(send)} wheels ({total / MIB:,.0f} MiB) to {dest}")
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for w in send:
            tar.add(w, arcname=w.name)
    res = await transport.run(wheel_unpack_argv(dest), input=buf.getvalue(), timeout=1800)
    if not res.ok:
        raise SetupError(f"{host.name}: pushing the wheelhouse to {dest}: {res.error_line()}")
    return dest


async def setup_env(
    transport: Transport,
    host: HostConfig,
    *,
    base_python: str,
    wheelhouse: Path | None = None,
    spec: EnvSpec | None = None,
    progress: Progress = print,
) -> str:
    """Build (or find up to date) the env; returns "built" or "unchanged". SetupError else."""
    spec = spec or env_spec()
    state = await transport.container_state()
    if state != "running":
        raise SetupError(f"{host.name}: container {host.ctid} is {state} (pct start {host.ctid})")
    wheels = await push_wheelhouse(transport, host, wheelhouse, progress) if wheelhouse else None
    where = spec_dir(host.workdir, spec.digest)
    res = await transport.run(unpack_argv(where), input=spec.tar())
    if not res.ok:
        raise SetupError(f"{host.name}: writing {where}: {res.error_line()}")
    outcome: str | None = None
    last = ""
    async for line in transport.stream_lines(setup_argv(base_python, host.workdir, where, wheels)):
        if line.startswith("setup-result: "):
            outcome = line.split()[1]
        elif line.strip():
            last = line
            progress(f"{host.name}: {line}")
    await transport.run(["rm", "-rf", where])
    if outcome in ("built", "unchanged"):
        return outcome
    if outcome is None:
        said = f": {last}" if last else ""
        raise SetupError(
            f"{host.name}: {base_python} did not run the setup script in container "
            f"{host.ctid}{said}; install python3 and python3-venv there (or pass --python)"
        )
    raise SetupError(f"{host.name}: setup failed: {last.removeprefix('setup: ')}")


async def env_note(transport: Transport, host: HostConfig, spec: EnvSpec) -> str | None:
    """What deploy says about the env setup built: older than the lock, or none at all."""
    if not host.python.startswith(f"{host.workdir}/env/"):
        return None  # an interpreter the inventory names: not ours to judge
    res = await transport.run(env_info_argv(host.workdir))
    text = res.stdout.strip()
    if not text:
        return f"{host.name}: no env set up in the container yet: dflashctl setup {host.name}"
    try:
        info = json.loads(text)
    except ValueError:
        return f"{host.name}: the container's env record is unreadable: dflashctl setup {host.name}"
    if info.get("lock") != spec.lock_sha:
        return (
            f"{host.name}: the container's env (built {info.get('built')}) is older than "
            f"requirements.lock ({info.get('lock')} there, {spec.lock_sha} here): "
            f"dflashctl setup {host.name}"
        )
    return None
