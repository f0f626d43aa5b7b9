"""`dflashctl status`, `logs` and `attach`: what a run is doing, its status.log, its tmux."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
from typing import TYPE_CHECKING

from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.errors import ExitCode
from dflashctl.remote.connect import attach_argv, make_transport
from dflashctl.remote.transport import Transport

if TYPE_CHECKING:
    from dflashctl.runs.snapshot import RunStatus


from dflashctl.cli.common import (
    Subparsers,
    command_adder,
    inventory,
    print_line,
    resolve,
    target_of,
    with_transport,
)


async def cmd_status(args: argparse.Namespace) -> int:
    """Hosts and groups as named (every host when none is); a group is one entry: its state,
    the node and rank that failed first, and one entry per node (`dflashctl.groups.control`)."""
    from dflashctl.cli.status_text import format_run_status
    from dflashctl.runs.control import RunControl

    inv = inventory(args)
    targets = resolve(inv, args.host) if args.host else list(inv.hosts.values())

    async def one(host: HostConfig) -> RunStatus:
        transport = make_transport(host)
        try:
            return await RunControl(transport, host).status()
        finally:
            await transport.close()

    async def each(target: HostConfig | GroupConfig) -> RunStatus | list[RunStatus]:
        if isinstance(target, GroupConfig):
            return list(await asyncio.gather(*(one(h) for h in target.nodes)))
        return await one(target)

    results = await asyncio.gather(*(each(t) for t in targets))
    entries: list[object] = []
    states: list[str] = []
    for target, got in zip(targets, results, strict=True):
        if isinstance(got, list):
            assert isinstance(target, GroupConfig)
            entries.append(group_entry(target, got, as_json=args.json))
            states += [st.state for st in got]
        else:
            entries.append(got.to_json_dict() if args.json else format_run_status(got))
            states.append(got.state)
    if args.json:
        print(json.dumps(entries, indent=2, default=str))
    else:
        for e in entries:
            print(e)
    if states and all(s == "unreachable" for s in states):
        return ExitCode.UNREACHABLE
    return ExitCode.OK


def group_entry(group: GroupConfig, sts: list[RunStatus], *, as_json: bool) -> object:
    """A group's status: `{group, state, summary, world_size, step, nodes, failed}` for --json,
    else its summary line and each node's status (indented)."""
    from dflashctl.cli.status_text import format_run_status
    from dflashctl.groups.state import NodeReport, group_json, group_state

    view = group_state(group.name, [NodeReport.from_status(st, i) for i, st in enumerate(sts)])
    if as_json:
        return dict(group_json(view))
    lines = [view.summary()]
    if view.world_size is not None:
        lines[0] += f" (world size {view.world_size})"
    if (where := view.checkpoint_line()) is not None:
        lines.append(f"  {where}")
    for a in view.history:  # every failed attempt: who failed first, what followed
        after = (
            "the group restarted and trains again"
            if a.resumed
            else "the group is restarting"
            if a.restarted
            else "not restarted"
        )
        lines.append(f"  {a.line()} -> {after}")
    for i, st in enumerate(sts):
        node = view.nodes[i]
        ranks = f" ranks {node.rank_range[0]}-{node.rank_range[1] - 1}" if node.rank_range else ""
        text = format_run_status(st)
        if not st.pane_tail:  # a dead pane's tail is printed already
            text += "".join(f"\n  | {ln}" for ln in st.pane_lines)
        lines.append(f"  node {i}{ranks}: " + text.replace("\n", "\n  "))
    return "\n".join(lines)


LOG_RESTARTED = "restarted: status.log started over; reading it from its first line"


async def cmd_logs(args: argparse.Namespace) -> int:
    target = target_of(args)
    if isinstance(target, GroupConfig):
        # every node's log, each line prefixed `HOST| ` (rank 0 on node 0 writes the run's)
        codes = await asyncio.gather(*(_logs(args, h, prefix=f"{h.name}| ") for h in target.nodes))
        return max(codes)
    return await _logs(args, target)


async def _logs(args: argparse.Namespace, host: HostConfig, prefix: str = "") -> int:
    from dflashctl.runs.control import RunControl
    from dflashctl.runs.follow import Connected, Line, LogRestarted, Lost

    def say(text: str) -> None:
        print(f"dflashctl: {text}", file=sys.stderr, flush=True)

    async def go(t: Transport) -> int:
        ctl = RunControl(t, host)
        st = await ctl.reader.status_for("logs")
        start = max(0, st.log_lines - args.lines)
        if not args.follow:
            for line in await ctl.log.log_tail(start):
                print_line(line, args.json, prefix)
            return ExitCode.OK
        lost = False
        async with contextlib.aclosing(ctl.follow(start)) as events:
            async for event in events:
                if isinstance(event, Line):
                    print_line(event.text, args.json, prefix)
                elif isinstance(event, Connected):
                    if lost:
                        say(f"{host.name}: reconnected")
                    lost = False
                elif isinstance(event, Lost):
                    lost = True
                    say(f"lost: {event.reason}; reconnecting")
                elif isinstance(event, LogRestarted):
                    say(f"{host.name}: {LOG_RESTARTED}")
        return ExitCode.OK

    return await with_transport(host, go)


async def cmd_attach(args: argparse.Namespace) -> int:
    target = target_of(args)
    if isinstance(target, GroupConfig):
        host = target.nodes[0]
        print(
            f"dflashctl: {target.name}: attaching to node 0 ({host.name}), whose rank 0 prints "
            f"the run's lines; `dflashctl attach {target.nodes[-1].name}` for another node",
            file=sys.stderr,
            flush=True,
        )
    else:
        host = target
    argv = attach_argv(host, os.environ.get("TERM", "xterm-256color"))
    if args.print:
        print(shlex.join(argv))
        return ExitCode.OK
    os.execvp(argv[0], argv)
    return ExitCode.FAILED  # not reached


def register(sub: Subparsers) -> None:
    """Adds status, logs, attach."""
    add = command_adder(sub)
    sp = sub.add_parser("status", help="run state, release, config hash, latest status line")
    sp.add_argument("host", nargs="*", help="hosts or groups (default: every host)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_status)
    sp = add("logs", cmd_logs, "print (or follow with -f) the run's status.log")
    sp.add_argument("-f", "--follow", action="store_true")
    sp.add_argument("-n", "--lines", type=int, default=20)
    sp.add_argument("--json", action="store_true", help="one parsed event per line as JSON")
    sp = add("attach", cmd_attach, "attach to the trainer's tmux session (interactive ssh -t)")
    sp.add_argument("--print", action="store_true", help="print the ssh command instead")
