"""Pipeline balance on CPU: which stage waits, measured from the trainer's own status lines.

Two runs of the real pipeline (`python -m trainer`, tiny target) with one stage slowed by a
test-only per-item sleep (DFLASH_STAGE_DELAY, standing in for GPU time that releases the GIL):

  drafter-bound: drafter +40 ms/step  -> the drafter should wait for data <= 3% of wall time
  target-bound:  target +80 ms/batch  -> q_hs should sit near 0 and the line should name the target

Steady state = status lines after the first 25% of the run. Run:
    .venv/bin/python benchmarks/bench_pipeline.py
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import TrainConfig  # noqa: E402
from trainer.config.overlay import TomlTable, dump_toml, merge  # noqa: E402
from trainer.events import StatusEvent, parse_line  # noqa: E402

SCENARIOS = {
    "drafter-bound": ("drafter:0.04", 300),
    "target-bound": ("target:0.08", 150),
}


def _config(root: Path) -> TomlTable:
    raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    raw = merge(
        raw,
        {
            "data": {"store": str(root / "store")},
            "model": {"target_dir": str(root / "target")},
            "batching": {"token_budget": 512, "max_batch": 8},
            "status": {"interval_s": 1.0, "rate_window_s": 5.0},
            "checkpoint": {"every_steps": 100000, "every_minutes": 600.0},
        },
    )
    from trainer.pipeline import assets

    cfg = TrainConfig.from_dict(raw)
    assets.ensure_store(cfg)
    assets.ensure_target(cfg)
    return raw


def _run(root: Path, raw: TomlTable, name: str, delay: str, steps: int) -> list[StatusEvent]:
    cfg = root / f"{name}.toml"
    cfg.write_text(dump_toml(merge(raw, {"schedule": {"max_steps": steps}})))
    env = {**os.environ, "DFLASH_STAGE_DELAY": delay, "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "trainer", "--config", str(cfg), "--run-dir", str(root / name)]
    subprocess.run(argv, cwd=REPO, env=env, check=True, capture_output=True, timeout=600)
    lines = (root / name / "status.log").read_text().splitlines()
    status = [e for e in map(parse_line, lines) if isinstance(e, StatusEvent) and e.extra]
    return status[len(status) // 4 : -1]  # steady state: skip warm-up and the final line


def _pct(s: StatusEvent, key: str) -> float:
    return float(s.extra[key].rstrip("%"))


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = _config(root)
        print(
            f"{'scenario':<14} {'lines':>5} {'w_dft_in':>9} {'w_tgt_in':>9} {'w_tgt_out':>9} "
            f"{'q_hs':>5} {'tgt b/s':>8} {'dft b/s':>8}  bottleneck (share of lines)"
        )
        for name, (delay, steps) in SCENARIOS.items():
            st = _run(root, raw, name, delay, steps)
            votes = [s.extra["bottleneck"] for s in st]
            top = max(set(votes), key=votes.count)
            print(
                f"{name:<14} {len(st):>5} {statistics.mean(_pct(s, 'w_dft_in') for s in st):>8.1f}% "
                f"{statistics.mean(_pct(s, 'w_tgt_in') for s in st):>8.1f}% "
                f"{statistics.mean(_pct(s, 'w_tgt_out') for s in st):>8.1f}% "
                f"{statistics.mean(s.q_hs[0] for s in st):>5.2f} "
                f"{statistics.mean(s.tgt_bps or 0 for s in st):>8.2f} "
                f"{statistics.mean(s.dft_bps or 0 for s in st):>8.2f}  "
                f"{top} ({votes.count(top)}/{len(votes)})"
            )


if __name__ == "__main__":
    main()
