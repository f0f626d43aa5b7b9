"""`python -m trainer.doctor --config RUN.toml [--json]`: see `trainer.doctor`.

The config and the target's shape are read before torch loads, so a bad path is one line and
exit 2 in a second; each stage's line is printed as it finishes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from trainer.doctor.plan import DoctorConfigError, load_plan
from trainer.doctor.report import StageResult, exit_code, summary, to_json
from trainer.errors import ExitCode


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.doctor",
        description="Device self-test for a run config: allocation, the drafter's attention and "
        "CE kernels, one drafter step, the feature copy and NCCL, per configured device.",
    )
    ap.add_argument("--config", required=True, type=Path, help="run config (TOML)")
    ap.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = ap.parse_args(argv)
    try:
        plan = load_plan(args.config)
    except DoctorConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return int(ExitCode.USAGE)
    if not args.json:
        drafters, targets = ", ".join(plan.drafter_devices), ", ".join(plan.target_devices)
        print(f"trainer.doctor: {args.config}: drafter {drafters}; target {targets}", flush=True)

    from trainer.doctor.stages import run_stages  # torch loads here

    results: list[StageResult] = []
    for res in run_stages(plan):
        results.append(res)
        if not args.json:
            print(res.line(), flush=True)
    if args.json:
        print(to_json(str(args.config), results))
    else:
        print(summary(results))
    return exit_code(results)
