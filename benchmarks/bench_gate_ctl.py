"""`dflashctl gate HOST` wall time on the tiny config, over the real parts.

OpenSSH sshd on loopback -> pct shim -> lxc-attach -> an LXC container running the committed
trainer (deployed by `dflashctl deploy`), configs/tiny-cpu.toml with a 64-row store. Each round
is the CLI as an operator runs it (`python -m dflashctl gate ct`, a fresh process: inventory,
SSH, the job's tmux session, follow, the verdict), timed from the client; beside it the gate's
own seconds (its JSON: imports not included) and its stages. The first round also builds the
tiny target and store in the container (run/.cache), as a first start would. Then the cache:
`start` with `gate = "before-start"` after a pass runs no gate (the lookup's round trip).

Run: .venv/bin/python benchmarks/bench_gate_ctl.py [ROUNDS]   (root; sshd, lxc, tmux)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.ctl import parts as P  # noqa: E402
from tests.ctl.test_jobs import tiny_gate_config  # noqa: E402


def dflashctl(inv: Path, *args: str) -> tuple[float, subprocess.CompletedProcess[str]]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "dflashctl", "--hosts", str(inv), *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    return time.perf_counter() - t0, done


def main(rounds: int) -> None:
    with tempfile.TemporaryDirectory(prefix="bench-gate-") as tmp_s:
        tmp = Path(tmp_s)
        cfg = tmp / "run.toml"
        cfg.write_text(tiny_gate_config())
        with P.real_parts(tmp / "parts") as parts:
            inv = Path(P.pinned_inventory(parts, tmp, run_config=cfg)[1])
            inv.write_text(inv.read_text() + 'gate = "before-start"\n')
            tree = P.frozen_tree(tmp / "tree")
            _, done = dflashctl(inv, "deploy", "ct", "--tree", str(tree), "--no-memory-check")
            assert done.returncode == 0, done.stderr
            rows = []
            for i in range(rounds):
                wall, done = dflashctl(inv, "gate", "ct")
                assert done.returncode == 0, done.stdout + done.stderr
                _, res = dflashctl(inv, "gate", "ct", "--result", "--json")
                got = json.loads(res.stdout)
                stages = {s["stage"]: s["seconds"] for s in got["stages"]}
                rows.append((wall, got["seconds"], stages))
                print(
                    f"round {i + 1}: dflashctl gate {wall:.1f} s wall, the gate's own "
                    f"{got['seconds']:.1f} s, stages "
                    + " ".join(f"{k} {v:.1f}" for k, v in stages.items()),
                    flush=True,
                )
            walls = [r[0] for r in rows[1:]] or [rows[0][0]]
            print(
                f"dflashctl gate: first {rows[0][0]:.1f} s (builds the tiny assets), then "
                f"median {statistics.median(walls):.1f} s ({min(walls):.1f}-{max(walls):.1f})"
            )
            wall, done = dflashctl(inv, "start", "ct", "--wait-s", "0")
            assert done.returncode == 0 and "not run again" in done.stdout, done.stdout
            print(f"start with a cached pass: {wall:.1f} s wall (no gate run)")
            dflashctl(inv, "stop", "ct")
            wall, done = dflashctl(inv, "start", "ct", "--wait-s", "0", "--no-gate")
            print(f"start --no-gate: {wall:.1f} s wall")
            dflashctl(inv, "stop", "ct")
            P.kill_tmux_in(parts.container)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 4)
