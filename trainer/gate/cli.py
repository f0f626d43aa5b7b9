"""One-sample overfit gate: does a drafter of this run's shape, trained on one sample until it
memorises it, accept nearly the whole block in the project's loop and in the serving engine?

    python -m trainer.gate --config RUN.toml [--out DIR] [--sample I] [--samples N]
        [--response-tokens N] [--max-steps N] [--device cpu|cuda] [--json OUT]
        [--engine vllm (--server URL | --serve-cmd CMD [--serve-arg ARG ...])]

SpecForge's cheapest end-to-end check, made ours. The run's target, layer ids, mask token and
drafter shape come from RUN.toml (a tiny target or a synthetic store is built when configured,
as `python -m trainer` does). Sample I of the store (and the N - 1 after it) keeps its prompt;
its response is replaced by the target's own greedy continuation (`--response-tokens`, default
the sample's response length, at most 64), since acceptance is agreement with what the target
says. Then, stage by stage (`trainer.gate.stages`): capture, masks, train, decode, export and,
with `--engine`, the engine on the export (started with `--serve-cmd` and stopped after, or a
`--server` already serving DIR/export). It passes when tau >= 0.9 x block size in every loop
that ran; otherwise it stops at the first stage that broke and names it. Exit status: 0 passed,
1 failed at a stage, 2 a usage or config error.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from trainer.errors import ExitCode, TrainerError
from trainer.events.served import ENGINE_METAVAR, engine_arg
from trainer.gate.report import GateFailure, Report
from trainer.serving.served_eval import EngineSpec, serve_cmd_problem

MAX_RESPONSE = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.gate",
        description="Overfit one sample, export, and check the drafter accepts it in our loop "
        "and in the serving engine; names the stage that broke.",
    )
    p.add_argument("--config", required=True, type=Path, help="the run's TOML config")
    p.add_argument("--out", type=Path, default=None, help="where the export goes (default: temp)")
    p.add_argument("--sample", type=int, default=0, help="store row to memorise (default 0)")
    p.add_argument("--samples", type=int, default=1, help="rows from --sample on (default 1)")
    p.add_argument(
        "--response-tokens",
        type=int,
        default=None,
        help=f"target tokens to memorise per sample (default: the response's, at most "
        f"{MAX_RESPONSE})",
    )
    p.add_argument("--max-steps", type=int, default=400, help="training steps at most")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (default 3e-3)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when visible)")
    p.add_argument("--json", type=Path, default=None, help="also write the stages as JSON here")
    served = p.add_argument_group("the engine stage")
    served.add_argument(
        "--engine", type=engine_arg, default=None, metavar=ENGINE_METAVAR, help="also decode there"
    )
    served.add_argument(
        "--server", default=None, metavar="URL", help="an engine serving OUT/export"
    )
    served.add_argument(
        "--serve-cmd", default=None, metavar="CMD", help="start the engine with this command"
    )
    served.add_argument(
        "--serve-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="engine argument (repeatable)",
    )
    served.add_argument("--serve-timeout", type=float, default=600.0, help="seconds to come up")
    served.add_argument("--serve-log", type=Path, default=None, help="the started engine's log")
    return p


def check_args(args: argparse.Namespace) -> None:
    if args.sample < 0 or args.samples < 1:
        raise TrainerError("--sample must be >= 0 and --samples >= 1")
    if args.max_steps < 1 or (args.response_tokens is not None and args.response_tokens < 2):
        raise TrainerError("--max-steps must be >= 1 and --response-tokens >= 2")
    reach = [v for v in (args.server, args.serve_cmd) if v]
    if args.engine is None and (reach or args.serve_arg):
        raise TrainerError("--server, --serve-cmd and --serve-arg need --engine vllm")
    if args.engine is not None and len(reach) != 1:
        raise TrainerError("--engine needs exactly one of --server URL or --serve-cmd CMD")
    if (problem := serve_cmd_problem(args.serve_cmd)) is not None:
        raise TrainerError(problem)
    if not args.config.is_file():
        raise TrainerError(f"--config {args.config}: no such file")


def engine_spec(args: argparse.Namespace) -> EngineSpec | None:
    if args.engine is None:
        return None
    return EngineSpec(
        args.engine,
        args.server,
        args.serve_cmd,
        tuple(args.serve_arg),
        args.serve_timeout,
        args.serve_log,
    )


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    report = Report()
    failure: str | None = None
    code = ExitCode.OK
    try:
        check_args(args)
        from trainer.gate.run import run_gate  # torch loads only for a good command line

        out = args.out or Path(tempfile.mkdtemp(prefix="dflash-gate-"))
        run_gate(args, out, engine_spec(args), report)
    except GateFailure as failed:
        failure, code = str(failed), ExitCode.FAILED
        print(f"gate FAILED at stage {failed.stage}: {failed.detail}", file=sys.stderr)
    except TrainerError as err:  # config, store, target, engine start: one line
        failure, code = str(err), err.exit_code
        print(f"error: {err}", file=sys.stderr)
    else:
        print(
            f"gate PASSED in {report.payload(passed=True, failure=None)['seconds']:.1f} s: "
            f"{report.summary()}"
        )
    if args.json is not None:
        payload = report.payload(passed=code == ExitCode.OK, failure=failure)
        args.json.write_text(json.dumps(payload, indent=2) + "\n")
    return code
