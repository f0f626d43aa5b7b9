"""python -m trainer.measure --config RUN.toml [--strategies sorted,bucketed,...] --steps N
    [--warmup W] [--rounds R] [--save-calibration FILE] [--predict-with FILE] [--json]
    [--out DIR]

Runs the config's real pipeline (its devices, target, drafter and data) for N timed optimizer
steps per strategy after W untimed warm-up steps, the strategies interleaved over R rounds (the
order rotates each round, so a drift in machine speed does not favour one), and prints per
strategy: samples/s, real tokens/s, anchor blocks/s, padded tokens/s, padding efficiency, the
largest batch, diversity (share of co-batched pairs repeating next epoch), the ratio of each rate
to sorted's in the same round (median and range), and the step-cost model's predicted rates next
to the measured ones. The fitted model (coefficients, R^2) is printed and, with
--save-calibration, written for `python -m trainer.buckets plan --objective time`;
--predict-with FILE also shows what an earlier calibration predicted for this config.
`packed@N` in --strategies is packed with `batching.row_length = N` (row lengths side by side).
--out DIR also writes the result as DIR/result.json and DIR/table.txt (each published whole, by a
rename: a reader never sees half of one), for a run nobody watches (`dflashctl measure`).
Progress goes to stderr, one line per timing run: `round 1/2 sorted: 17,312 tok/s (run 1 of 10)`.

Exit 2 with one line for a bad flag, strategy or config key; 1 when a pipeline stage fails.
SIGHUP or SIGTERM (a closed tmux session, `dflashctl measure HOST --stop`) ends it as Ctrl-C
does: the timing run is killed and the temporary run directories (each holds the run's final
checkpoint) are removed, exit 128 + the signal.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import tempfile
import tomllib
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from trainer.config import STRATEGIES, ConfigError
from trainer.errors import TrainerError

DEFAULT_STRATEGIES = ("sorted", "bucketed", "pool-sort", "packed", "random")


class UsageError(TrainerError, ValueError):
    """A bad command line (names the flag)."""


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m trainer.measure", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--config", required=True, help="run config (TOML)")
    ap.add_argument(
        "--strategies",
        default=None,
        help="comma-separated, in order; packed@N = packed with rows of N tokens (default: "
        f"every strategy the config accepts of {','.join(DEFAULT_STRATEGIES)})",
    )
    ap.add_argument("--steps", type=int, required=True, help="timed optimizer steps per strategy")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps before (default 5)")
    ap.add_argument("--rounds", type=int, default=2, help="interleaved rounds (default 2)")
    ap.add_argument(
        "--window",
        type=int,
        default=None,
        help="steps per fitted window (default: 8, fewer for short runs)",
    )
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="wall time (default) or the trainer's CPU seconds (steady on a shared machine)",
    )
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key for every run, e.g. batching.pool_size=400 (TOML value)",
    )
    ap.add_argument("--save-calibration", help="write the fitted step-cost model (JSON) here")
    ap.add_argument("--predict-with", help="also predict with this earlier calibration (JSON)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument(
        "--out",
        metavar="DIR",
        help="also write DIR/result.json and DIR/table.txt (each published by a rename)",
    )
    return ap


def parse_strategies(text: str | None) -> list[str]:
    """Strategy names in order; `packed@N` is packed with `batching.row_length = N`, so row
    lengths can be compared in one run (`drive.variant`)."""
    from trainer.measure.drive import variant

    if text is None:
        return [s for s in DEFAULT_STRATEGIES if s in STRATEGIES]
    names = [s.strip() for s in text.split(",") if s.strip()]
    if not names:
        raise UsageError("--strategies: no strategy named")
    for s in names:
        try:
            base, _ = variant(s)
        except ValueError as exc:
            raise UsageError(f"--strategies: {exc}") from None
        if base not in STRATEGIES:
            raise UsageError(
                f"--strategies: {s!r} is not a batching strategy (this trainer has: "
                f"{', '.join(STRATEGIES)}; packed@N for rows of N tokens)"
            )
    if len(set(names)) != len(names):
        raise UsageError(f"--strategies: {text!r} names a strategy twice")
    return names


def overrides(items: Sequence[str]) -> dict[str, Any]:
    """`--set a.b=VALUE` items as one nested table (VALUE is a TOML value; a bare word is a
    string)."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        parts = [p.strip() for p in key.split(".")]
        if not sep or not all(parts):
            raise UsageError(f"--set: {item!r} is not KEY=VALUE (e.g. batching.pool_size=400)")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        node = out
        for p in parts[:-1]:
            node = node.setdefault(p, {})
        node[parts[-1]] = value
    return out


def _check(args: argparse.Namespace) -> None:
    for flag, value, low in (
        ("--steps", args.steps, 1),
        ("--warmup", args.warmup, 0),
        ("--rounds", args.rounds, 1),
    ):
        if value < low:
            raise UsageError(f"{flag}: must be >= {low}, got {value}")
    if args.window is not None and not 1 <= args.window <= args.steps:
        raise UsageError(f"--window: must be in [1, --steps], got {args.window}")
    if args.out:  # found before the runs, not after hours of them
        out = Path(args.out)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise UsageError(f"--out: {out}: {exc.strerror or exc}") from None
        if not os.access(out, os.W_OK | os.X_OK):
            raise UsageError(f"--out: {out}: not writable")


def measure(args: argparse.Namespace) -> dict[str, object]:
    """The whole measurement; the JSON result."""
    from trainer.bucketing.timecost import CalibrationError, StepCostModel
    from trainer.measure.drive import Measurer, StrategyRun
    from trainer.measure.report import build_result, default_window

    strategies = parse_strategies(args.strategies)
    _check(args)
    prior = None
    if args.predict_with:
        try:
            prior = StepCostModel.load(args.predict_with)
        except CalibrationError as exc:
            raise UsageError(f"--predict-with: {exc}") from None
    with tempfile.TemporaryDirectory(prefix="dflash-measure-") as work:
        m = Measurer.from_file(args.config, Path(work), overrides(args.set))
        for s in strategies:
            m.check(s, args.steps, args.warmup)
        runs: dict[str, list[StrategyRun]] = {s: [] for s in strategies}
        total, done = args.rounds * len(strategies), 0
        for r in range(args.rounds):
            k = r % len(strategies)  # rotate the order: a drift in speed favours no one
            for s in strategies[k:] + strategies[:k]:
                run = m.run(s, args.steps, args.warmup, f"{r}-{s}")
                runs[s].append(run)
                done += 1
                rate = float(run.real_tokens.sum()) / float(run.ends[-1])
                print(
                    f"round {r + 1}/{args.rounds} {s}: {rate:,.0f} tok/s (run {done} of {total})",
                    file=sys.stderr,
                    flush=True,
                )
        infos = m.infos
    cfg = m.cfg
    meta: dict[str, object] = {
        "config": str(args.config),
        "overrides": list(args.set),
        "device": m.device(),
        "steps": args.steps,
        "warmup": args.warmup,
        "rounds": args.rounds,
        "token_budget": cfg.batching.token_budget,
        "max_batch": cfg.batching.max_batch,
        "document_attention": m.document_lengths(cfg) is not None,
    }
    window = args.window or default_window(args.steps)
    result, model = build_result(
        runs, infos, window=window, meta=meta, prior=prior, clock=args.clock
    )
    if args.save_calibration:
        result["calibration_file"] = str(model.save(Path(args.save_calibration)))
    return result


def _publish(path: Path, text: str) -> None:
    """Write `text` to `path` whole: a temp file next to it, fsync, rename."""
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with tmp.open("w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def write_out(out: Path, result: dict[str, object], table: str) -> None:
    """--out DIR: result.json, then table.txt (its presence says both are there)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        _publish(out / "result.json", json.dumps(result, indent=1) + "\n")
        _publish(out / "table.txt", table + "\n")
    except OSError as exc:
        raise UsageError(f"--out: {out}: {exc.strerror or exc}") from None


class Stopped(BaseException):
    """SIGHUP/SIGTERM: unwinds like KeyboardInterrupt (temporary directories removed)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _stop(signum: int, frame: object) -> None:
    for sig in (signal.SIGHUP, signal.SIGTERM):  # a second one must not cut the cleanup short
        signal.signal(sig, signal.SIG_IGN)
    raise Stopped(signum)


def main(argv: Sequence[str] | None = None) -> int:
    from trainer.measure.report import format_table

    args = _parser().parse_args(argv)
    for sig in (signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, _stop)
    try:
        return _main(args, format_table)
    except Stopped as stop:
        with contextlib.suppress(OSError):  # stderr may be a closed pane
            print(f"error: stopped by {signal.Signals(stop.signum).name}", file=sys.stderr)
        return 128 + stop.signum


def _main(args: argparse.Namespace, format_table: Callable[[dict[str, object]], str]) -> int:
    try:
        result = measure(args)
        table = format_table(result) if args.out or not args.json else ""
        if args.out:
            write_out(Path(args.out), result, table)
    except (ConfigError, UsageError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except TrainerError as exc:  # a bad --steps (2), a failed timing run (1)
        print(f"error: {exc}", file=sys.stderr)
        return int(exc.exit_code)
    print(json.dumps(result, indent=1) if args.json else table)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
