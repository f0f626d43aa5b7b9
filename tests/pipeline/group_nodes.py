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


def c10d_argv(
    node: int, nnodes: int, port: int, *, nproc: int = 1, max_restarts: int = 0, rdzv_id: str = "g"
) -> list[str]:
    """torchrun with the c10d rendezvous as dflashctl launches a group node: node 0 hosts it,
    every agent names its address (both 127.0.0.1 here, so c10d orders the nodes by pid)."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        rdzv_id,
        "--rdzv-conf",
        f"is_host={'true' if node == 0 else 'false'},join_timeout=120",
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        str(max_restarts),
    ]


def c10d_env(node: int) -> dict[str, str]:
    """What dflashctl adds to a group node's environment for torchrun and the trainer."""
    return {
        "DFLASH_NODE_RANK": str(node),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "LOGLEVEL": "INFO",
    }


def supervised(node: int, torchrun: list[str], *policy: str) -> list[str]:
    """The group node's supervisor (dflashctl's start GROUP) in front of its torchrun."""
    return [
        sys.executable,
        "-m",
        "trainer.supervise",
        "--group-node",
        str(node),
        *policy,
        "--",
        *torchrun,
    ]


def supervisor_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "supervisor.json"
    if not path.exists():
        return {}
    try:
        state: dict[str, Any] = json.loads(path.read_text())
    except ValueError:  # mid-rename never happens, but a test must not die on it
        return {}
    return state
