"""How long a checkpoint blocks the drafter thread (issue 16 item 7), on the tiny CPU config.

Builds the real parts (`build_parts`, tiny target, no stages running) and times
`Checkpointer.save(step)` on the calling thread, as the drafter's loop calls it, `--saves`
times `--gap-s` apart (so a background write has finished before the next save, as it does in a
run whose interval exceeds the write). With `--repo DIR` the trainer is imported from DIR
instead, e.g. an unpacked older commit for the before figure:

    git archive c4f7bf3 trainer | tar -x -C /tmp/before
    .venv/bin/python benchmarks/bench_checkpoint.py --repo /tmp/before
    .venv/bin/python benchmarks/bench_checkpoint.py [--hidden 512]

`--hidden` widens the tiny target (and so the drafter) to show how the blocked time scales
with the state's size. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", type=Path, default=REPO)
    ap.add_argument("--saves", type=int, default=8)
    ap.add_argument("--gap-s", type=float, default=1.0)
    ap.add_argument("--hidden", type=int, default=64)
    args = ap.parse_args()
    sys.path.insert(0, str(args.repo))
    sys.path.insert(1, str(REPO))  # config overlay helpers, unchanged between versions

    import torch

    from trainer.config import TrainConfig
    from trainer.config.overlay import merge
    from trainer.pipeline import assets
    from trainer.pipeline.build import build_parts
    from trainer.pipeline.checkpointer import Checkpointer
    from trainer.pipeline.distributed import World
    from trainer.pipeline.evaluate import Best
    from trainer.pipeline.faults import FaultPlan
    from trainer.pipeline.status import Board, Reporter, RunRecord, RunStateFile

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
        raw = merge(
            raw,
            {
                "data": {"store": str(REPO / "configs" / ".cache" / "tiny-store")},
                "model": {
                    "target_dir": str(root / "target"),
                    "tiny_target": {"hidden_size": args.hidden},
                },
                "checkpoint": {"keep_last": 2},
            },
        )
        cfg = TrainConfig.from_dict(raw)
        assets.ensure_store(cfg)
        assets.ensure_target(cfg)
        run_dir = root / "run"
        run_dir.mkdir()
        parts = build_parts(cfg, World(), run_dir, FaultPlan())
        # the optimizer's moments exist after its first step, as in any real checkpoint
        for prm in parts.params:
            prm.grad = torch.zeros_like(prm)
        parts.opt.step()
        board = Board()
        with open(run_dir / "lines.log", "w") as sink:
            reporter = Reporter(run_dir, enabled=True, stream=sink)
            record = RunRecord(RunStateFile(run_dir), reporter, True)
            ckpt = Checkpointer(parts, board, Best(), reporter, record)
            blocked, total = [], []
            for i in range(args.saves):
                t0 = time.perf_counter()
                if "wait" in inspect.signature(ckpt.save).parameters:
                    ckpt.save(i + 1, wait=False)  # as the drafter's periodic saves call it
                else:
                    ckpt.save(i + 1)  # before: always synchronous
                t1 = time.perf_counter()
                drain = getattr(ckpt, "drain", None)
                if drain is not None:
                    drain()
                t2 = time.perf_counter()
                blocked.append(t1 - t0)
                total.append(t2 - t0)
                time.sleep(args.gap_s)
        size = (run_dir / "checkpoints" / f"step-{args.saves:08d}.pt").stat().st_size
    print(
        json.dumps(
            {
                "repo": str(args.repo),
                "hidden": args.hidden,
                "checkpoint_mib": round(size / 2**20, 2),
                "saves": args.saves,
                "blocked_ms_median": round(statistics.median(blocked) * 1e3, 2),
                "blocked_ms_max": round(max(blocked) * 1e3, 2),
                "write_ms_median": round(statistics.median(total) * 1e3, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
