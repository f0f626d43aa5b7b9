"""In-training evaluation cost: its share of wall time on the tiny CPU config, side by side.

Runs the real trainer (`python -m trainer`) on the bundled tiny CPU config with the same
held-out exclusion, evaluation off and at several (every_steps, max_rows) settings, alternating
the cases in each round so they share the machine's load. Per case: the run's wall time, the
trainer's own eval seconds and share of the drafter loop's wall time (run-state.json
`eval_seconds`/`eval_share`, what the Eval line prints as cost=), and the measured wall-time
overhead against the eval-off run of the same round.

Run: .venv/bin/python benchmarks/bench_eval.py [--steps 200] [--rounds 3] [--holdout 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config.overlay import dump_toml, merge  # noqa: E402

CASES: list[tuple[str, int | None, int]] = [
    ("off", None, 0),
    ("every 100, 16 rows", 100, 16),
    ("every 100, 64 rows", 100, 64),
    ("every 25, 16 rows", 25, 16),
    ("every 25, 64 rows", 25, 64),
]


def _config(root: Path, steps: int, holdout: int, every: int | None, rows: int) -> Path:
    raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    ev: dict[str, object] = {"holdout_rows": holdout}
    if every is not None:
        ev.update(every_steps=every, max_rows=rows)
    raw = merge(
        raw,
        {
            "data": {"store": str(root / "store")},
            "model": {"target_dir": str(root / "target")},
            "schedule": {"max_steps": steps},
            "checkpoint": {"every_steps": 10_000, "every_minutes": 600.0},
            "eval": ev,
        },
    )
    path = root / f"run-{every}-{rows}.toml"
    path.write_text(dump_toml(raw))
    return path


def _run(cfg: Path, run_dir: Path) -> tuple[float, float, float | None, int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    argv = [sys.executable, "-m", "trainer", "--config", str(cfg), "--run-dir", str(run_dir)]
    t0 = time.perf_counter()
    out = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{cfg.name}: exit {out.returncode}\n{out.stdout[-2000:]}")
    state = json.loads((run_dir / "run-state.json").read_text())
    n = sum(1 for x in (run_dir / "status.log").read_text().splitlines() if x.startswith("Eval:"))
    return wall, float(state.get("eval_seconds") or 0.0), state.get("eval_share"), n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--holdout", type=int, default=64, help="eval.holdout_rows of every case")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        walls: dict[str, list[float]] = {c[0]: [] for c in CASES}
        evals: dict[str, list[float]] = {c[0]: [] for c in CASES}
        shares: dict[str, list[float]] = {c[0]: [] for c in CASES}
        overhead: dict[str, list[float]] = {c[0]: [] for c in CASES}
        per_eval: dict[str, list[float]] = {c[0]: [] for c in CASES}
        _run(_config(root, 5, args.holdout, None, 0), root / "warm")  # build store + target
        for r in range(args.rounds):
            off = None
            for name, every, rows in CASES:
                wall, spent, share, n = _run(
                    _config(root, args.steps, args.holdout, every, rows), root / f"r{r}-{name}"
                )
                off = wall if every is None else off
                walls[name].append(wall)
                evals[name].append(spent)
                shares[name].append(100 * share if share else 0.0)
                per_eval[name].append(spent / n if n else 0.0)
                if off is not None:
                    overhead[name].append(100 * (wall - off) / wall)
        print(
            f"tiny CPU config, {args.steps} steps, holdout {args.holdout} rows, "
            f"{args.rounds} rounds (median)"
        )
        print(
            f"{'case':<22} {'wall s':>7} {'eval s':>7} {'s/eval':>7} {'share':>7}"
            f" {'wall vs off':>12}"
        )
        for name, _, _ in CASES:
            print(
                f"{name:<22} {statistics.median(walls[name]):7.2f}"
                f" {statistics.median(evals[name]):7.2f} {statistics.median(per_eval[name]):7.3f}"
                f" {statistics.median(shares[name]):6.1f}% {statistics.median(overhead[name]):+11.1f}%"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
