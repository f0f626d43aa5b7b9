"""How fast a group heals, and what the elastic rendezvous costs at start (loopback CPU figures).

Two nodes of one group on this machine, each with its own run dir, each its supervisor in
front of torchrun with the c10d rendezvous (node 0 hosting it), exactly as `dflashctl start
GROUP` runs them (tests/pipeline/test_group_supervise.py's harness), the tiny CPU config with
one rank per node, a checkpoint every 10 steps:

* rank death: SIGKILL node 1's rank; the time from the kill to node 0's first new step after
  the group's resume (its first metrics row after the new "Resuming from checkpoint" line),
  KILLS times, p50 and the spread;
* agent death: the same for node 1's torchrun agent (its supervisor restarts it after the
  policy's backoff, 1 s here; the default 10 s adds 9 s);
* start: from launching both nodes to node 0's first step, the group's launch (supervisors,
  c10d) against the static launch it replaced (bare torchrun, `--rdzv-backend static`),
  interleaved ROUNDS times, fresh run dirs each time.

Both nodes share this machine's two cores with other jobs: loopback CPU figures.

Run: .venv/bin/python benchmarks/bench_group_recovery.py [--kills 5] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import TrainConfig  # noqa: E402
from trainer.config.overlay import dump_toml, merge  # noqa: E402

POLICY = ["--max-restarts", "50", "--backoff-s", "1", "--stall-timeout-s", "300"]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def env_for(node: int, launch: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "WORLD", "RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(REPO))
    env.update(DFLASH_NODE_RANK=str(node), DFLASH_LAUNCH_ID=launch, LOGLEVEL="INFO")
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    return env


def torchrun(node: int, port: int, backend: str) -> list[str]:
    argv = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"]
    argv += ["--nproc-per-node", "1", "--rdzv-backend", backend]
    argv += ["--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts"]
    if backend == "static":
        return [*argv, "0", "--node-rank", str(node)]
    conf = f"is_host={'true' if node == 0 else 'false'},join_timeout=300"
    return [*argv, "50", "--rdzv-id", "g", "--rdzv-conf", conf, "--local-addr", "127.0.0.1"]


def launch(root: Path, backend: str, supervised: bool) -> list[subprocess.Popen[bytes]]:
    port, procs = free_port(), []
    for node in range(2):
        d = root / f"node{node}"
        program = ["-m", "trainer", "--config", str(root / "run.toml"), "--run-dir", str(d)]
        argv = [*torchrun(node, port, backend), *program]
        if supervised:
            argv = [sys.executable, "-m", "trainer.supervise", "--group-node", str(node)]
            argv += [*POLICY, "--", *torchrun(node, port, backend), *program]
        env = env_for(node, root.name)
        if backend == "static":
            env.pop("DFLASH_NODE_RANK")
        procs.append(
            subprocess.Popen(
                argv, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
            )
        )
    return procs


def rows(run_dir: Path) -> int:
    try:
        return sum(1 for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln)
    except FileNotFoundError:
        return 0


def resumes(run_dir: Path) -> int:
    try:
        text = (run_dir / "status.log").read_text()
    except FileNotFoundError:
        return 0
    return len(re.findall(r"^Resuming from checkpoint: ", text, re.M))


def wait(what: str, done: Any, timeout: float = 600.0) -> float:
    end = time.monotonic() + timeout
    while not done():
        if time.monotonic() > end:
            raise RuntimeError(f"not reached within {timeout:g} s: {what}")
        time.sleep(0.02)
    return time.monotonic()


def read(path: Path) -> dict[str, Any]:
    got: dict[str, Any] = json.loads(path.read_text())
    return got


def heal_time(node0: Path, kill: Any) -> float:
    """Seconds from `kill()` to node 0's first step after the group's next resume."""
    wait("node 0 trains", lambda: rows(node0) >= 12)
    before = resumes(node0)
    t0 = time.monotonic()
    kill()
    wait("the group resumes", lambda: resumes(node0) > before)
    base = rows(node0)  # rows of steps done before the kill land before the resume line
    return wait("node 0's first new step", lambda: rows(node0) > base) - t0


def stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(120)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def deaths(base: Path, raw: dict[str, Any], kills: int, agent: bool) -> list[float]:
    root = base / ("agent" if agent else "rank")
    root.mkdir()
    (root / "run.toml").write_text(dump_toml(raw))
    procs = launch(root, "c10d", supervised=True)
    node0, node1 = root / "node0", root / "node1"
    times = []
    try:
        for _ in range(kills):

            def kill() -> None:
                if agent:
                    os.kill(read(node1 / "supervisor.json")["agent_pid"], signal.SIGKILL)
                else:
                    os.kill(read(node1 / "run-state.json")["pid"], signal.SIGKILL)

            times.append(heal_time(node0, kill))
            n = rows(node0)
            wait("a few steps more", lambda n=n: rows(node0) >= n + 12)  # a checkpoint after it
    finally:
        stop(procs)
    return times


def start_time(base: Path, raw: dict[str, Any], name: str, backend: str, sup: bool) -> float:
    root = base / name
    root.mkdir()
    (root / "run.toml").write_text(dump_toml(raw))
    t0 = time.monotonic()
    procs = launch(root, backend, sup)
    try:
        return wait("the first step", lambda: rows(root / "node0") >= 1) - t0
    finally:
        stop(procs)


def summary(xs: list[float]) -> dict[str, Any]:
    return {
        "p50_s": round(statistics.median(xs), 2),
        "min_s": round(min(xs), 2),
        "max_s": round(max(xs), 2),
        "each_s": [round(x, 2) for x in xs],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    base = Path(tempfile.mkdtemp(prefix="bench-heal-"))
    raw = merge(
        tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text()),
        {
            "data": {"store": str(base / "assets" / "store")},
            "model": {"target_dir": str(base / "assets" / "target")},
            "schedule": {"epochs": 50},
            "status": {"interval_s": 1},
            "checkpoint": {"every_steps": 10, "every_minutes": 600.0, "keep_last": 2},
        },
    )
    from trainer.pipeline import assets

    cfg = TrainConfig.from_dict(raw)
    assets.ensure_store(cfg)
    assets.ensure_target(cfg)
    static, elastic = [], []
    for n in range(args.rounds):  # interleaved: the box's other load hits both alike
        static.append(start_time(base, raw, f"static-{n}", "static", sup=False))
        elastic.append(start_time(base, raw, f"c10d-{n}", "c10d", sup=True))
    report = {
        "rank_death_to_first_new_step": summary(deaths(base, raw, args.kills, agent=False)),
        "agent_death_to_first_new_step": summary(deaths(base, raw, args.kills, agent=True)),
        "start_to_first_step_static": summary(static),
        "start_to_first_step_c10d_supervised": summary(elastic),
        "loadavg_after": os.getloadavg(),
        "cores": os.cpu_count(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
