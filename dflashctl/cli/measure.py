"""`dflashctl buckets` and `measure`: the bucket planner and the throughput measure on a host."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.config.inventory import GroupConfig
from dflashctl.errors import ExitCode, UsageError
from dflashctl.errors import print_error as print_err
from dflashctl.remote.transport import Transport

if TYPE_CHECKING:
    from dflashctl.runs.measure import MeasureControl, MeasureState


from dflashctl.cli import detached
from dflashctl.cli.common import Subparsers, command_adder, say, target_of, with_transport


async def cmd_buckets(args: argparse.Namespace) -> int:
    target = target_of(args)
    host = target.nodes[0] if isinstance(target, GroupConfig) else target  # same data everywhere
    store = args.store or host.data_store
    if store is None:
        raise UsageError(
            f"{host.name}: no data store: pass --store PATH or set data_store in hosts.toml"
        )

    async def go(t: Transport) -> int:
        argv = [
            "env",
            f"PYTHONPATH={host.workdir}/current",
            host.python,
            "-m",
            "trainer.buckets",
            "plan",
            "--lengths",
            store,
            "--buckets",
            str(args.buckets),
            "--token-budget",
            str(args.token_budget),
            "--max-batch",
            str(args.max_batch),
        ]
        if args.min_share is not None:
            argv += ["--min-share", str(args.min_share)]
        if args.json:
            argv.append("--json")
        res = await t.run(argv, timeout=600)
        from trainer.events import sanitize_for_terminal

        sys.stdout.write(sanitize_for_terminal(res.stdout))  # the planner's table: remote text
        if not res.ok:
            print_err(f"{host.name}: planner failed: {res.error_line()}")
            return ExitCode.FAILED
        return ExitCode.OK

    return await with_transport(host, go)


async def cmd_measure(args: argparse.Namespace) -> int:
    """`measure HOST|GROUP`: start (and follow) trainer.measure on the host, or with --result /
    --stop act on its newest measure (`dflashctl.runs.measure`). A group measures on node 0."""
    from dflashctl.runs.measure import (
        DETACH_GRACE_S,
        MeasureControl,
        MeasureRequest,
        check_local_target,
        parse_strategies,
    )

    name = args.host
    host = detached.node0_host(args, "measuring")
    calibration = Path(args.save_calibration) if args.save_calibration else None
    if calibration is not None and not args.stop:
        check_local_target(calibration)  # before a measure of hours, not after it
    if args.id is not None and not args.result:
        raise UsageError("measure: --id ID goes with --result (which measure's result)")
    req: MeasureRequest | None = None
    if not (args.result or args.stop):
        if args.steps is None:
            raise UsageError(
                "measure: --steps N is required to start a measure (--result prints the "
                "latest one, --stop ends a running one)"
            )
        req = MeasureRequest(
            steps=args.steps,
            warmup=args.warmup,
            rounds=args.rounds,
            strategies=parse_strategies(args.strategies) if args.strategies else None,
            window=args.window,
            clock=args.clock,
            sets=tuple(args.set),
        )
        req.check()

    async def go(t: Transport) -> int:
        mc = MeasureControl(t, host)
        if args.stop:
            detached.print_stopped(host.name, "measure", await mc.stop())
            return ExitCode.OK
        if req is None:
            st = await mc.state(measure_id=args.id)
            return await _measure_outcome(mc, st, args, name, calibration)
        started = await mc.start(req)
        what = f"measure {started.measure_id}"
        detached.say_started(
            host.name, what, started.session, started.release, started.directory, started.argv
        )
        if args.detach:
            # a refusal comes within moments
            st = await mc.state(0, DETACH_GRACE_S, started.measure_id)
            if st.running:
                detached.say_detached(host.name, "measure", name)
                return ExitCode.OK
            return await _measure_outcome(mc, st, args, name, calibration)

        def line(text: str) -> None:
            if not text.startswith("error: "):  # the outcome's own line says it once
                say(f"{host.name}: {text}")

        try:
            st = await mc.follow(
                line, lambda note: say(f"{host.name}: {note}"), measure_id=started.measure_id
            )
        except asyncio.CancelledError:  # Ctrl-C: this client leaves, the measure does not
            detached.say_goes_on(host.name, what, started.session, "measure", name)
            raise
        return await _measure_outcome(mc, st, args, name, calibration)

    return await with_transport(host, go)


async def _measure_outcome(
    mc: MeasureControl,
    st: MeasureState,
    args: argparse.Namespace,
    name: str,
    calibration: Path | None,
) -> int:
    """Print the newest measure's result (and fetch its calibration), or raise what it is."""
    from dflashctl.runs.measure import MeasureError, MeasureRunning, how_far, outcome_error
    from dflashctl.runs.snapshot import iso_utc

    host = mc.host.name
    if (st.state == "none" or st.measure_id is None) and args.id:
        raise MeasureError(f"{host}: no measure {args.id} in {mc.host.workdir}/measure")
    if st.state == "none" or st.measure_id is None:
        raise MeasureError(
            f"{host}: no measure has run here; `dflashctl measure {name} --steps N` starts one"
        )
    if st.running:
        raise MeasureRunning(
            f"{host}: measure {st.measure_id} is still running ({st.since()}): "
            f"{how_far(st.progress)}; `dflashctl measure {name} --result` again later, "
            f"`--stop` ends it"
        )
    error = outcome_error(st, st.progress)
    if error is not None:
        raise error
    started = st.started
    say(
        f"{host}: measure {st.measure_id} (started {iso_utc(started) if started else '?'}, "
        f"release {st.info.get('release', '?')}): {st.directory}"
    )
    print(await mc.result(st, as_json=args.json), flush=True)
    if calibration is not None:
        path = await mc.fetch_calibration(st, calibration)
        say(f"{host}: calibration saved to {path}")
    return ExitCode.OK


def register(sub: Subparsers) -> None:
    """Adds buckets, measure."""
    add = command_adder(sub)
    sp = add("buckets", cmd_buckets, "run the bucket planner on the host's data store")
    sp.add_argument("--store", help="token store or .npy lengths in the container")
    sp.add_argument("--buckets", type=int, default=6, help="number of buckets K (default 6)")
    sp.add_argument("--token-budget", type=int, required=True, help="padded tokens per batch")
    sp.add_argument("--max-batch", type=int, required=True, help="samples per batch")
    sp.add_argument("--min-share", type=float, default=None, help="min share of samples/bucket")
    sp.add_argument("--json", action="store_true", help="the planner's JSON instead of a table")
    sp = add(
        "measure",
        cmd_measure,
        "measure batching strategies' throughput on a host (python -m trainer.measure on its "
        "deployed release and run config, in its own tmux session; a group: on node 0)",
        host=False,
    )
    sp.add_argument("host", help="a host, or a group (measured on its node 0)")
    sp.add_argument(
        "--strategies",
        metavar="LIST",
        help="comma-separated, e.g. sorted,packed,packed@4096 (packed@N: rows of N tokens; "
        "default: every one the release has)",
    )
    sp.add_argument(
        "--steps", type=int, metavar="N", help="timed optimizer steps per strategy and round"
    )
    sp.add_argument(
        "--warmup", type=int, metavar="W", help="untimed steps before each (trainer default 5)"
    )
    sp.add_argument("--rounds", type=int, metavar="R", help="interleaved rounds (default 2)")
    sp.add_argument("--window", type=int, metavar="N", help="steps per fitted window")
    sp.add_argument("--clock", choices=("wall", "cpu"), help="wall (default) or CPU seconds")
    sp.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a run-config key for every timing run (TOML value); repeatable",
    )
    sp.add_argument("--json", action="store_true", help="the result as JSON instead of a table")
    sp.add_argument(
        "--save-calibration",
        metavar="FILE",
        help="fetch the fitted step-cost model (JSON) to this local file",
    )
    detached.add_modes(
        sp,
        "measure",
        detach="start it and return (it runs on in tmux)",
        id_help="with --result: that measure (as started prints it, e.g. 20261201T170211Z), not "
        "the newest",
    )
