"""What every dflashctl command shares: the inventory, host and group lookups, transports,
the run flags, and printing (no command of its own)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, TypeAlias

from dflashctl.config.inventory import GroupConfig, HostConfig, Inventory, load_inventory
from dflashctl.errors import UsageError
from dflashctl.errors import print_error as print_err
from dflashctl.remote.connect import make_transport
from dflashctl.remote.transport import Transport

if TYPE_CHECKING:
    from dflashctl.groups.control import GroupControl
    from dflashctl.runs.service import StartResult


Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
Command = Callable[[argparse.Namespace], Awaitable[int]]


def command_adder(sub: Subparsers) -> Callable[..., argparse.ArgumentParser]:
    """`add(name, fn, help, host=True)`: a subcommand running `fn`, with a `host` argument."""

    def add(name: str, fn: Command, help: str, host: bool = True) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        if host:
            sp.add_argument("host", help="a host, or a group (every node of it)")
        sp.set_defaults(func=fn)
        return sp

    return add


def inventory(args: argparse.Namespace) -> Inventory:
    inv = load_inventory(args.hosts)
    for warning in inv.warnings:
        print_err(f"warning: {warning}")
    return inv


def host_of(args: argparse.Namespace) -> HostConfig:
    return inventory(args).get(args.host)


def target_of(args: argparse.Namespace) -> HostConfig | GroupConfig:
    """The host or group `args.host` names (one namespace: load refuses a clash)."""
    return resolve(inventory(args), [args.host])[0]


def resolve(inv: Inventory, names: Sequence[str]) -> list[HostConfig | GroupConfig]:
    """Hosts and groups by name; without groups in the file an unknown name is the plain
    "no host" error (whose message lists the hosts), else one that lists both."""
    if not inv.groups:
        return [inv.get(n) for n in names]
    return inv.resolve_targets(names)


async def with_group(group: GroupConfig, fn: Callable[[GroupControl], Awaitable[int]]) -> int:
    """Run `fn` over a GroupControl with one transport per node, all closed after."""
    from dflashctl.groups.control import GroupControl

    transports = [make_transport(h) for h in group.nodes]
    try:
        return await fn(GroupControl(group, transports))
    finally:
        await asyncio.gather(*(t.close() for t in transports), return_exceptions=True)


async def with_transport(host: HostConfig, fn: Callable[[Transport], Awaitable[int]]) -> int:
    transport = make_transport(host)
    try:
        return await fn(transport)
    finally:
        await transport.close()


def resume_choice(args: argparse.Namespace) -> str:
    from dflashctl.releases.resume import ResumeChoiceError, validate_resume_choice

    if args.resume is None:
        return "auto"
    if args.fresh:
        raise UsageError("--fresh and --resume exclude each other (--fresh starts over)")
    try:
        return validate_resume_choice(args.resume)
    except ResumeChoiceError as err:
        raise UsageError(str(err)) from None


def wait_s_of(args: argparse.Namespace, host: HostConfig) -> float:
    if args.wait_s is None:
        return float(host.start_wait)
    if args.wait_s < 0:
        raise UsageError(f"--wait-s {args.wait_s:g}: must be 0 (do not wait) or more")
    return float(args.wait_s)


def readiness(name: str, res: StartResult) -> str:
    if res.ready is None:
        return f"{name}: not waited for (see `dflashctl status {name}`)"
    if res.ready:
        return f"{name}: the trainer is past its setup after {res.waited_s:.0f} s"
    return (
        f"{name}: still setting up after {res.waited_s:.0f} s (no phase line yet); "
        f"`dflashctl status {name}` or `logs -f` shows how it goes"
    )


def print_line(line: str, as_json: bool, prefix: str = "") -> None:
    if as_json:
        from trainer.events import parse_line

        event = parse_line(line).model_dump_json()
        host = prefix.removesuffix("| ")
        # a group's lines: {"host": ..., "event": ...} (the event's own keys stay untouched)
        print(f'{{"host": {json.dumps(host)}, "event": {event}}}' if host else event, flush=True)
    else:
        print(prefix + line, flush=True)


def say(text: str) -> None:
    """A note on stderr (stdout keeps only the result: `measure HOST --json > out.json`)."""
    print(f"dflashctl: {text}", file=sys.stderr, flush=True)


def add_run_flags(sp: argparse.ArgumentParser) -> None:
    from dflashctl.runs.service import DEFAULT_START_WAIT_S

    sp.add_argument(
        "--resume",
        metavar="PATH|STEP",
        help="resume from this checkpoint (a path, or a step of run/checkpoints) instead of "
        "the newest usable one",
    )
    sp.add_argument(
        "--wait-s",
        type=float,
        default=None,
        help="seconds to wait for the trainer to finish its setup or exit (default: start_wait "
        f"in hosts.toml, {DEFAULT_START_WAIT_S:g}; 0: do not wait)",
    )
