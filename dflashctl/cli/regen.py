"""`dflashctl regen HOST`: regenerate a chat file with the target, in the host's container
(`dflashctl.runs.regen`): start it (detached; `--follow` prints its lines until it ends),
`--status` (the newest job), `--stop`."""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex

from dflashctl.cli.common import Subparsers, command_adder, host_of, say, with_transport
from dflashctl.errors import ExitCode, UsageError
from dflashctl.remote.transport import Transport


def _flags(args: argparse.Namespace) -> tuple[str, ...]:
    """trainer.regen's flags from ours (only those given: its defaults stay its own)."""
    out: list[str] = []
    for flag, value in (
        ("--model", args.model),
        ("--reasoning", args.reasoning),
        ("--concurrency", args.concurrency),
        ("--max-tokens", args.max_tokens),
        ("--temperature", args.temperature),
        ("--on-length", args.on_length),
        ("--template-kwargs", args.template_kwargs),
        ("--sampling", args.sampling),
        ("--limit", args.limit),
    ):
        if value is not None:
            out += [flag, str(value)]
    for extra in args.regen_arg:
        out += shlex.split(extra)
    return tuple(out)


async def cmd_regen(args: argparse.Namespace) -> int:
    from dflashctl.runs.regen import RegenControl, RegenError, RegenRequest
    from dflashctl.runs.regen_view import regen_line

    host = host_of(args)
    req: RegenRequest | None = None
    if not (args.status or args.stop):
        req = RegenRequest(
            inputs=tuple(args.input or ()),
            out=args.out or "",
            servers=tuple(u.rstrip("/") for u in args.server),
            serve=args.serve,
            serve_wait_s=args.serve_wait_s,
            flags=_flags(args),
            resume=args.resume,
        )
        req.check()
    elif args.input or args.out:
        raise UsageError("regen: --input/--out start a job; not with --status or --stop")

    async def go(t: Transport) -> int:
        rc = RegenControl(t, host)
        if args.stop:
            stopped = await rc.stop()
            if stopped is None:
                print(f"{host.name}: no regeneration job is running")
            else:
                print(regen_line(host.name, stopped).strip())
            return ExitCode.OK
        if req is None:
            rep = await rc.report()
            if rep.job is None:
                print(f"{host.name}: no regeneration job has run here")
                return ExitCode.OK
            if args.json:
                print(json.dumps({"host": host.name, "regen": rep.job.to_json_dict()}, indent=1))
            else:
                print(f"{host.name}:")
                print(regen_line(host.name, rep.job))
            return ExitCode.OK if rep.job.state != "failed" else ExitCode.FAILED
        started = await rc.start(req)
        engine = f"; engine: {shlex.join(started.engine)}" if started.engine else ""
        say(
            f"{host.name}: regeneration job {started.job_id} started in tmux session "
            f"{started.session!r} (release {started.release}), writing {started.directory}: "
            f"{shlex.join(started.argv)}{engine}"
        )
        if not args.follow:
            say(
                f"{host.name}: detached; `dflashctl regen {host.name} --status` shows how far it "
                f"is, `--stop` ends it; `dflashctl status {host.name}` and the TUI show it too"
            )
            return ExitCode.OK
        try:
            job = await rc.follow(
                lambda line: print(f"{host.name}| {line}", flush=True),
                lambda note: say(f"{host.name}: {note}"),
                job_id=started.job_id,
            )
        except asyncio.CancelledError:  # Ctrl-C: this client leaves, the job does not
            say(
                f"{host.name}: regeneration job {started.job_id} goes on in tmux session "
                f"{started.session!r}; `dflashctl regen {host.name} --status` shows it, `--stop` "
                "ends it"
            )
            raise
        print(regen_line(host.name, job).strip())
        if job.state != "finished":
            raise RegenError(
                f"{host.name}: regeneration job {job.id} {job.state}: {job.supervisor_detail or job.error or 'see its status.log'}"
            )
        return ExitCode.OK

    return await with_transport(host, go)


def register(sub: Subparsers) -> None:
    """Adds regen."""
    add = command_adder(sub)
    sp = add(
        "regen",
        cmd_regen,
        "regenerate a chat file with the target through its serving engine (python -m "
        "trainer.regen in the container, supervised; --serve also starts the engine)",
    )
    sp.add_argument("--input", nargs="+", metavar="PATH", help="chat file(s) in the container")
    sp.add_argument(
        "--out", metavar="PATH", help="OUT.jsonl in the container (errors: OUT.errors.jsonl)"
    )
    sp.add_argument(
        "--server", action="append", default=[], metavar="URL", help="a running engine (repeatable)"
    )
    sp.add_argument(
        "--serve",
        metavar="CMD",
        help="start the engine in the job's tmux window `engine`, e.g. \"vllm serve /models/Qwen3-8B "
        '--reasoning-parser qwen3 --data-parallel-size 8"; stopped when the job ends',
    )
    sp.add_argument(
        "--serve-wait-s",
        type=float,
        default=1800.0,
        help="how long the engine may take to answer /health",
    )
    sp.add_argument("--model", help="the served model name (default: the server's first)")
    sp.add_argument(
        "--reasoning",
        choices=("none", "save", "disable"),
        help="the thinking mode (trainer.regen's default: none)",
    )
    sp.add_argument("--concurrency", type=int, help="requests in flight per server")
    sp.add_argument("--max-tokens", type=int, help="per reply")
    sp.add_argument("--temperature", type=float, help="0: greedy")
    sp.add_argument("--on-length", choices=("keep", "drop"), help="a reply cut at --max-tokens")
    sp.add_argument(
        "--template-kwargs", metavar="JSON", help="chat_template_kwargs sent with every request"
    )
    sp.add_argument("--sampling", metavar="JSON", help="more request fields")
    sp.add_argument("--limit", type=int, help="only the first N usable rows")
    sp.add_argument(
        "--resume",
        action="store_true",
        help="continue the OUT an earlier job left (its rows and errors are skipped)",
    )
    sp.add_argument(
        "--regen-arg",
        action="append",
        default=[],
        metavar="ARGS",
        help="more trainer.regen flags, as one shell word list",
    )
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument("--follow", action="store_true", help="print the job's lines until it ends")
    mode.add_argument(
        "--status", action="store_true", help="the newest job: how far, how fast, errors"
    )
    mode.add_argument("--stop", action="store_true", help="stop the running job (and its engine)")
    sp.add_argument("--json", action="store_true", help="with --status: JSON")
