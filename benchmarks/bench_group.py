"""Group start time and 1x2 vs 2x1 throughput on the loopback pair (loopback CPU figures).

Two "Proxmox hosts" (loopback sshd + pct shim each) and two LXC containers in the host's
network namespace, the tiny CPU config with one rank per node, as tests/ctl/test_group_run.py
runs them:

* group start: from `dflashctl start g` being called to node 0's first metrics row (its step 1
  is all-reduced, so every rank of both nodes finished it), polled every 20 ms on the bind
  mount while `start` runs; and to `start` returning (node 0 past its setup, every node's
  torchrun alive); ROUNDS times (stop g in between, each start resuming node 0's checkpoint).
* throughput: optimizer steps per second between steps WARM and WARM + SPAN, for the group
  (2 nodes x 1 rank, through dflashctl) and for the same config as 1 node x 2 ranks
  (`torchrun --standalone --nproc-per-node 2` on this machine, no container).

Both share this machine's cores: these are loopback CPU figures, a check that the group adds
no cost of its own, not a network measurement.

Run: .venv/bin/python benchmarks/bench_group.py   (root; needs sshd, lxc, tmux; ~4 minutes)
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflashctl.cli.main import main as cli_main  # noqa: E402
from tests.ctl import parts as P  # noqa: E402
from trainer.config.overlay import dump_toml, merge  # noqa: E402

ROUNDS = 3
WARM, SPAN = 20, 150


def rows(run_dir: Path) -> int:
    try:
        return sum(1 for ln in (run_dir / "metrics.jsonl").read_text().splitlines() if ln)
    except FileNotFoundError:
        return 0


def wait_rows(run_dir: Path, n: int, timeout: float = 300.0) -> float:
    end = time.monotonic() + timeout
    while rows(run_dir) < n:
        if time.monotonic() > end:
            raise RuntimeError(f"{run_dir}: fewer than {n} metrics rows after {timeout:g} s")
        time.sleep(0.02)
    return time.monotonic()


def steps_per_s(run_dir: Path, base: int) -> float:
    """Steps/s between rows base + WARM and base + WARM + SPAN, timed as they appear."""
    t0 = wait_rows(run_dir, base + WARM)
    t1 = wait_rows(run_dir, base + WARM + SPAN)
    return SPAN / (t1 - t0)


def cli(inv: Path, *args: str) -> None:
    with open(os.devnull, "w") as sink, contextlib.redirect_stdout(sink):
        rc = cli_main(["--hosts", str(inv), *args])
    if rc != 0:
        raise RuntimeError(f"dflashctl {' '.join(args)}: exit {rc}")


def start_group(inv: Path, done: list[float]) -> None:
    cli(inv, "start", "g", "--wait-s", "240")
    done.append(time.monotonic())


def single_host(config: Path, tree: Path, env: dict[str, str], run_dir: Path) -> float:
    """Steps/s of the same config as 1 node x 2 ranks (torchrun --standalone, no container)."""
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["-m", "trainer", "--config", str(config), "--run-dir", str(run_dir)]
    proc = subprocess.Popen(
        argv, cwd=tree, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        return steps_per_s(run_dir, 0)
    finally:
        proc.send_signal(signal.SIGINT)  # torchrun passes it on: the ranks stop
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="bench-group-"))
    tree = P.frozen_tree(base / "tree")
    shared = base / "assets"
    raw = merge(
        tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text()),
        {
            "data": {"store": str(shared / "store")},
            "model": {"target_dir": str(shared / "target")},
            "schedule": {"epochs": 20},
            "checkpoint": {"every_steps": 100000, "every_minutes": 600.0},
        },
    )
    config = base / "run.toml"
    config.write_text(dump_toml(raw))
    P.build_tiny_assets(config, tree)

    env = P.tree_env(tree)
    starts: list[float] = []
    returns: list[float] = []
    two_by_one: list[float] = []
    one_by_two: list[float] = []
    with P.group_pair(base, run_config=config, shared=(shared,)) as pair:
        run0 = pair.containers[0].workdir_host / "run"
        cli(pair.inventory, "deploy", "g", "--tree", str(tree), "--no-memory-check")
        for n in range(ROUNDS):  # interleaved, so the box's other load hits both alike
            one_by_two.append(single_host(config, tree, env, base / f"single-{n}"))
            before = rows(run0)
            t0 = time.monotonic()
            done: list[float] = []
            th = threading.Thread(target=start_group, args=(pair.inventory, done))
            th.start()
            starts.append(wait_rows(run0, before + 1) - t0)
            th.join()
            returns.append(done[0] - t0)
            two_by_one.append(steps_per_s(run0, before))
            cli(pair.inventory, "stop", "g", "--timeout", "120")
    report: dict[str, Any] = {
        "group_start_to_first_step_s": [round(x, 2) for x in starts],
        "group_start_command_returns_s": [round(x, 2) for x in returns],
        "steps_per_s_2x1_group": [round(x, 2) for x in two_by_one],
        "steps_per_s_1x2_single_host": [round(x, 2) for x in one_by_two],
        "ratio_2x1_over_1x2": round(
            statistics.median(two_by_one) / statistics.median(one_by_two), 3
        ),
        "loadavg_after": os.getloadavg(),
        "cores": os.cpu_count(),
    }
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
