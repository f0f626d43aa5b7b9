"""Tracker overhead per status interval: no tracker vs TensorBoard vs W&B (offline) vs both.

Each round opens every configuration in its own temporary run directory, then logs the same
status intervals through each in turn (one status event per interval, an eval event every 10th,
the trainer's real lines parsed by trainer.events), so the cases are measured side by side under
the same load. Wall time in the caller (what the trainer's status loop waits for) per interval;
open (start) and close (flush/finish) are timed apart, once per round.

Run: .venv/bin/python benchmarks/bench_tracking.py [--intervals 300] [--rounds 5]
Nothing leaves the machine: W&B is offline and its dirs point into the temporary directory.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

CASES: dict[str, list[str]] = {
    "none": [],
    "tensorboard": ["tensorboard"],
    "wandb (offline)": ["wandb"],
    "both": ["tensorboard", "wandb"],
}

STATUS = (
    "[12m] step={step} loss={loss:.4f} acc=0.613 streak=2.4 lr=5.90e-04 noise=0.0000 |"
    " tgt=3.10b/s dft=3.05b/s (8.2Ktok/s) | q_pre=[4, 4, 3, 3, 2, 2] q_hs=[2] | epoch~0.41"
    " ETA=1.2h | w_pre_out=0.0% w_tgt_in=1.2% w_tgt_out=30.5% w_dft_in=2.1% bottleneck=drafter"
    " gnorm=0.812 tau=3.214 loss_b=[1.9021,1.7002,1.3012,1.1010,0.9123,0.8123]"
)
EVAL = (
    "Eval: step={step} tau=3.214 loss=1.2345 acc=0.613"
    + "".join(f" acc@{k}={0.95 - k * 0.05:.3f}" for k in range(1, 16))
    + " tau_exp=3.368 best={step} | rows=256 share=2.3%"
)


def _sandbox(root: Path) -> None:
    for var, sub in (
        ("WANDB_DIR", "wandb"),
        ("WANDB_CONFIG_DIR", "config"),
        ("WANDB_CACHE_DIR", "cache"),
        ("WANDB_DATA_DIR", "data"),
    ):
        os.environ[var] = str(root / sub)
    os.environ.pop("WANDB_API_KEY", None)
    os.environ["WANDB_MODE"] = "offline"
    os.environ["WANDB_SILENT"] = "true"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--intervals", type=int, default=300, help="status intervals per case/round")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()

    from trainer.config import TrackingConfig
    from trainer.events import parse_line
    from trainer.tracking import event_scalars, log_event, open_trackers

    events = []
    for i in range(args.intervals):
        step = i * 10
        events.append([parse_line(STATUS.format(step=step, loss=4.0 / (i + 1)))])
        if i % 10 == 9:
            events[-1].append(parse_line(EVAL.format(step=step)))
    tags = {t for evs in events for ev in evs for t in event_scalars(ev)[1]}  # type: ignore[index]

    per_interval: dict[str, list[float]] = {c: [] for c in CASES}
    opens: dict[str, list[float]] = {c: [] for c in CASES}
    closes: dict[str, list[float]] = {c: [] for c in CASES}
    with tempfile.TemporaryDirectory() as tmp:
        _sandbox(Path(tmp))
        for r in range(args.rounds):
            trackers = {}
            for case, backends in CASES.items():
                run = Path(tmp) / f"r{r}-{case.split()[0]}"
                run.mkdir()
                t0 = time.perf_counter()
                trackers[case] = open_trackers(TrackingConfig(backends=backends), run)
                opens[case].append(time.perf_counter() - t0)
                assert trackers[case].names == backends, (case, trackers[case].names)
            # interleave: each case logs a slice of intervals in turn, so drift hits all alike
            spent = dict.fromkeys(CASES, 0.0)
            for lo in range(0, len(events), 25):
                for case, tracker in trackers.items():
                    t0 = time.perf_counter()
                    for evs in events[lo : lo + 25]:
                        for ev in evs:
                            log_event(tracker, ev)
                    spent[case] += time.perf_counter() - t0
            for case, tracker in trackers.items():
                per_interval[case].append(spent[case] / len(events))
                t0 = time.perf_counter()
                tracker.close()
                closes[case].append(time.perf_counter() - t0)

    interval_s = 30.0  # StatusConfig.interval_s's default
    print(
        f"{args.intervals} status intervals x {args.rounds} rounds, {len(tags)} tags,"
        f" load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (wall time)"
    )
    print(
        f"{'case':16s} {'per interval':>13s} {'best round':>11s} {'of 30 s':>8s}"
        f" {'1st open':>9s} {'open':>7s} {'close':>7s}"
    )
    for case in CASES:
        med = statistics.median(per_interval[case])
        print(
            f"{case:16s} {med * 1e6:10.1f} µs {min(per_interval[case]) * 1e6:8.1f} µs"
            f" {med / interval_s:8.4%} {opens[case][0]:8.2f}s"
            f" {statistics.median(opens[case]):6.2f}s {statistics.median(closes[case]):6.2f}s"
        )
    print("1st open includes importing the backend (torch + tensorboard, wandb) and, for W&B,")
    print("starting its service process; later opens in the same process reuse both.")


if __name__ == "__main__":
    main()
