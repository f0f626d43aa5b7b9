"""The supervisor's command line: its own flags (the restart Policy, the run dir, the disk check
period) before `--`, the trainer argv after it. A contradiction is a usage error (exit 2).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from trainer.config.policy import CHILDREN, RESTART_CHOICES, Policy

DISK_CHECK_S = 30.0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def _codes(text: str) -> frozenset[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if not p.isdigit() or not 0 < int(p) < 256]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not an exit status 1-255")
    return frozenset(int(p) for p in parts)


def parser(description: str) -> argparse.ArgumentParser:
    """The supervisor's own flags; every default is Policy()'s (the disk check: DISK_CHECK_S)."""
    p = argparse.ArgumentParser(
        prog="python -m trainer.supervise",
        usage="%(prog)s [OPTIONS] -- TRAINER_ARGV...",
        description=description,
    )
    d = Policy()
    p.add_argument("--restart", choices=RESTART_CHOICES, default=d.restart)
    p.add_argument("--max-restarts", type=_count, default=d.max_restarts)
    p.add_argument("--restart-window-s", type=_positive, default=d.restart_window_s)
    p.add_argument("--stall-timeout-s", type=_positive, default=d.stall_timeout_s)
    p.add_argument(
        "--startup-timeout-s",
        type=_positive,
        help=f"before the first step (default: the larger of {d.startup_timeout_s:g} and the "
        "stall timeout)",
    )
    p.add_argument(
        "--no-restart-exit-codes",
        type=_codes,
        default=d.no_restart_exit_codes,
        help="comma-separated exit statuses never restarted (default: 2, usage/config errors)",
    )
    p.add_argument("--backoff-s", type=_positive, default=d.backoff_s, help="first backoff")
    p.add_argument("--backoff-max-s", type=_positive, default=d.backoff_max_s)
    p.add_argument("--kill-grace-s", type=_positive, default=d.kill_grace_s)
    p.add_argument("--run-dir", type=Path, help="default: the trainer argv's --run-dir")
    p.add_argument(
        "--group-node",
        type=_count,
        help="a group node's index (dflashctl's inventory order): the argv is its torchrun "
        "(c10d rendezvous), whose worker-group restarts the group's policy counts",
    )
    p.add_argument(
        "--child",
        choices=CHILDREN,
        default="trainer",
        help="what the argv after -- runs: the trainer (restarts resume from its checkpoint), "
        "or a regeneration job (restarts add --resume; its Regen status lines are progress)",
    )
    p.add_argument(
        "--disk-check-s",
        type=_positive,
        default=DISK_CHECK_S,
        help="seconds between free-space checks of the run directory while the trainer runs",
    )
    return p


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(the supervisor's flags, the trainer argv): split at the first `--`."""
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def parse_policy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Policy:
    """The Policy the parsed flags give; a contradiction is a usage error (exit 2)."""
    if args.startup_timeout_s is None:
        args.startup_timeout_s = max(Policy().startup_timeout_s, args.stall_timeout_s)
    if args.startup_timeout_s < args.stall_timeout_s:
        parser.error(
            f"--startup-timeout-s {args.startup_timeout_s:g} is shorter than "
            f"--stall-timeout-s {args.stall_timeout_s:g}"
        )
    return Policy(
        restart=args.restart,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window_s,
        stall_timeout_s=args.stall_timeout_s,
        startup_timeout_s=args.startup_timeout_s,
        no_restart_exit_codes=args.no_restart_exit_codes,
        backoff_s=args.backoff_s,
        backoff_max_s=args.backoff_max_s,
        kill_grace_s=args.kill_grace_s,
    )
