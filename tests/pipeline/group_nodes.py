"""Several "nodes" of one training on this machine: one torchrun agent per node, each with its
own config file and run dir (nodes share no storage), as dflashctl launches a group."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

from trainer.config.overlay import dump_toml

from .conftest import REPO, cli_env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def node_dirs(root: Path, raw: dict[str, Any], n: int = 2) -> list[Path]:
    """`root/nodeI/` with `run.toml` = `raw` (relative paths resolve inside each node's dir)."""
    dirs = []
    for i in range(n):
        d = root / f"node{i}"
        d.mkdir(parents=True)
        (d / "run.toml").write_text(dump_toml(raw))
        dirs.append(d)
    return dirs


def static_argv(node: int, nnodes: int, port: int, nproc: int = 1) -> list[str]:
    """torchrun with the static rendezvous, up to the program."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--node-rank",
        str(node),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "static",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--max-restarts",
        "0",
    ]


def start_node(
    launcher: list[str], node_dir: Path, env: dict[str, str] | None = None
) -> subprocess.Popen[str]:
    """One node's torchrun running the trainer on its own `run.toml` and `run/`."""
    full = cli_env(**(env or {}))
    full.pop("WORLD_SIZE", None)
    program = ["-m", "trainer", "--config", str(node_dir / "run.toml")]
    program += ["--run-dir", str(node_dir / "run")]
    return subprocess.Popen(
        [*launcher, *program],
        cwd=REPO,
        env=full,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finish(procs: list[subprocess.Popen[str]], timeout: float = 240) -> list[tuple[int, str]]:
    out = []
    for p in procs:
        try:
            stdout, stderr = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            stdout, stderr = p.communicate()
        out.append((p.returncode, stdout[-3000:] + stderr[-3000:]))
    return out


def run_state(run_dir: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((run_dir / "run-state.json").read_text())
    return state
