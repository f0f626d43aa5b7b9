"""`python -m trainer --config run.toml --run-dir DIR [--resume auto|never|PATH|STEP] [--fresh]`.

Exit status: 0 finished or stopped cleanly by a signal (after a checkpoint), 1 a stage failed
(traceback printed), a checkpoint could not be written at the end, or the weights diverged,
2 a user error (config, data, checkpoint mismatch, an unusable --resume checkpoint; one line).
Under torchrun every rank runs this same command (data parallel).
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import signal
import sys
from pathlib import Path
from typing import TextIO

from trainer.errors import ExitCode

_STACKS: list[TextIO] = []  # the open file faulthandler writes to (it keeps only the descriptor)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer", description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, type=Path, help="run config (TOML)")
    p.add_argument("--run-dir", required=True, type=Path, help="status.log, checkpoints, ...")
    p.add_argument(
        "--resume",
        default="auto",
        help=(
            "auto: the newest usable checkpoint in RUN/checkpoints (unreadable, incomplete or "
            "non-finite newer ones are moved to RUN/checkpoints/rejected/); never; a checkpoint "
            "PATH; or a STEP number (RUN/checkpoints/step-STEP.pt)"
        ),
    )
    p.add_argument(
        "--fresh",
        action="store_true",
        help="start over: move RUN/checkpoints to RUN/checkpoints.old-<timestamp> first",
    )
    return p


def cuda_allocator_env() -> None:
    """`expandable_segments` unless the operator chose: set before torch can initialise CUDA
    (the allocator reads it once), so the trainer gets it however it is started."""
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")


def main(argv: list[str] | None = None) -> int:
    cuda_allocator_env()
    args = _parser().parse_args(argv)
    from trainer.config import ConfigError, TrainConfig

    try:  # torch-free: a bad config fails in a fraction of a second, before torch loads
        TrainConfig.load(args.config)
    except ConfigError as exc:
        print(f"ERROR: {exc}", flush=True)
        return ExitCode.USAGE
    # `kill -USR1 PID` (the supervisor's stall watchdog) dumps every thread's stack to the run log.
    args.run_dir.mkdir(parents=True, exist_ok=True)
    _STACKS.append(open(args.run_dir / "console.log", "a"))  # noqa: SIM115 (kept open for faulthandler)
    faulthandler.register(signal.SIGUSR1, file=_STACKS[-1], all_threads=True)
    from trainer.pipeline.build import RunOptions
    from trainer.pipeline.launch_env import repeated_launch
    from trainer.pipeline.runner import run

    if repeated_launch(args.run_dir) and (args.fresh or args.resume != "auto"):
        given = "--fresh" if args.fresh else f"--resume {args.resume}"
        print(f"Restarted within this launch: {given} was applied once; --resume auto", flush=True)
        args.fresh, args.resume = False, "auto"
    return run(RunOptions(args.config, args.run_dir, args.resume, args.fresh))


if __name__ == "__main__":
    sys.exit(main())
