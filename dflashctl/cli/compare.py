"""`dflashctl compare RUN RUN [RUN ...]`: runs side by side (`dflashctl.compare`)."""

from __future__ import annotations

import argparse
import asyncio
import json

from dflashctl.cli.common import Subparsers, command_adder, inventory, with_transport
from dflashctl.errors import ExitCode, UsageError
from dflashctl.remote.transport import Transport


async def cmd_compare(args: argparse.Namespace) -> int:
    from dflashctl.compare.align import Axis, align
    from dflashctl.compare.report import json_report, text_report
    from dflashctl.compare.sources import Picked, host_of, parse_spec, pick, read_host, read_local

    if len(args.runs) < 2:
        raise UsageError("compare: name at least two runs (HOST[~N] or PATH[~N])")
    if args.points < 1:
        raise UsageError(f"compare: --points {args.points}: must be >= 1")
    specs = [parse_spec(text) for text in args.runs]
    inv = inventory(args) if any(not s.local for s in specs) else None

    async def one(spec_index: int) -> Picked:
        spec = specs[spec_index]
        if spec.local:
            return pick(spec, read_local(spec))
        assert inv is not None
        host = host_of(spec, inv)
        lines: list[str] = []

        async def go(t: Transport) -> int:
            lines.extend(await read_host(spec, t, host))
            return 0

        await with_transport(host, go)
        return pick(spec, lines)

    picked = list(await asyncio.gather(*(one(i) for i in range(len(specs)))))
    axes: tuple[Axis, ...] = ("step", "tokens") if args.by == "both" else (args.by,)
    alignments = [align([p.curves for p in picked], axis, args.points) for axis in axes]
    if args.json:
        print(json.dumps(json_report(picked, alignments), indent=1))
    else:
        print("\n".join(text_report(picked, alignments)))
    return ExitCode.OK


def register(sub: Subparsers) -> None:
    """Adds compare."""
    add = command_adder(sub)
    sp = add(
        "compare",
        cmd_compare,
        "runs side by side: held-out tau and losses aligned by step and by tokens trained, and "
        "who is ahead (RUN: HOST, HOST~N = N fresh starts back, a group (node 0), or a local run "
        "directory / status.log with a '/')",
        host=False,
    )
    sp.add_argument("runs", nargs="+", metavar="RUN", help="HOST[~N], GROUP[~N] or PATH[~N]")
    sp.add_argument(
        "--by", choices=("step", "tokens", "both"), default="both", help="the axis (default both)"
    )
    sp.add_argument("--points", type=int, default=12, help="rows per table at most (default 12)")
    sp.add_argument("--json", action="store_true", help="the aligned points and leads as JSON")
