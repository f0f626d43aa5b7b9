"""`dflashctl watch`: poll hosts, print one line per state change, send notifications."""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dflashctl.config.inventory import GroupConfig, HostConfig, Inventory
from dflashctl.errors import ExitCode, UsageError
from dflashctl.errors import print_error as print_err
from dflashctl.remote.connect import make_transport

if TYPE_CHECKING:
    from dflashctl.alerts.notify import Notifier


from dflashctl.cli.common import Subparsers, inventory


def watch_hosts(inv: Inventory, names: Sequence[str]) -> list[HostConfig]:
    """`all` (or nothing) is every host; a group is its nodes; each host once, in order."""
    if not names or "all" in names:
        return list(inv.hosts.values())
    hosts: dict[str, HostConfig] = {}
    for target in inv.resolve_targets(names):
        for h in target.nodes if isinstance(target, GroupConfig) else (target,):
            hosts.setdefault(h.name, h)
    return list(hosts.values())


def watch_groups(inv: Inventory, hosts: Sequence[HostConfig]) -> list[GroupConfig]:
    """The groups whose every node is watched: each is watched as one (its nodes' run events
    become the group's, once per change of its state)."""
    names = {h.name for h in hosts}
    return [g for g in inv.groups.values() if set(g.hosts) <= names]


def _watch_notifier(inv: Inventory) -> Notifier | None:
    """The Notifier for the inventory's notify_urls_file, or None when it names none."""
    from dflashctl.alerts.notify import Notifier, NotifyConfigError, load_targets

    if inv.notify_urls_file is None:
        return None
    try:
        targets, errors = load_targets(inv.notify_urls_file)
    except NotifyConfigError as err:
        raise UsageError(f"{inv.path}: {err}") from None
    if errors:
        for line in errors[:-1]:
            print_err(f"{inv.path}: notify_urls_file {line}")
        raise UsageError(f"{inv.path}: notify_urls_file {errors[-1]}")
    return Notifier(targets)


async def cmd_watch(args: argparse.Namespace) -> int:
    import logging
    import signal

    from dflashctl.alerts.policy import PolicyConfig
    from dflashctl.alerts.watch import WatchSettings, poll_limit_s, run_watch

    for flag, value in (("--interval-s", args.interval_s), ("--burst-s", args.burst_s)):
        if not (value > 0 and value < float("inf")):
            raise UsageError(f"{flag} {value:g}: must be a number of seconds above 0")
    if not (0 <= args.drain_s < float("inf")):
        raise UsageError(f"--drain-s {args.drain_s:g}: must be 0 or more seconds")
    inv = inventory(args)
    hosts = watch_hosts(inv, args.host)
    if not hosts:
        raise UsageError(f"{inv.path}: no hosts to watch")
    notifier = None if args.no_notify else _watch_notifier(inv)
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("dflashctl: %(message)s"))
    for name in ("dflashctl.alerts.notify", "dflashctl.alerts.watch"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO if args.verbose else logging.WARNING)
    settings = WatchSettings(
        interval_s=args.interval_s,
        policy=PolicyConfig(unreachable_alert_s=inv.unreachable_alert_s, burst_s=args.burst_s),
        drain_s=args.drain_s,
        gpu=not args.no_gpu,
    )
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    where = (
        "printing only (--no-notify)"
        if args.no_notify
        else f"notifying {len(notifier.targets)} target(s) from {inv.notify_urls_file}"
        if notifier
        else "printing only (no notify_urls_file in the inventory)"
    )
    as_one = [g.name for g in watch_groups(inv, hosts)]
    print(
        f"dflashctl: watching {', '.join(h.name for h in hosts)} every {args.interval_s:g} s "
        + (f"(groups as one: {', '.join(as_one)}) " if as_one else "")
        + f"(unreachable alert after {inv.unreachable_alert_s:g} s, poll limit "
        f"{max(poll_limit_s(h) for h in hosts):g} s); {where}",
        file=sys.stderr,
        flush=True,
    )

    def emit(line: str) -> None:
        print(line, flush=True)

    from dflashctl.groups.watch import GroupWatcher

    groups = [GroupWatcher(g) for g in watch_groups(inv, hosts)]
    try:
        outcome = await run_watch(
            hosts,
            settings,
            make_transport=make_transport,
            notifier=notifier,
            stop=stop,
            emit=emit,
            groups=groups,
        )
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    print(f"dflashctl: {outcome.summary(args.drain_s)}", file=sys.stderr, flush=True)
    return ExitCode.OK


def register(sub: Subparsers) -> None:
    """Adds watch."""
    sp = sub.add_parser(
        "watch",
        help="poll hosts, print one line per state change, send notifications (headless)",
        description="Poll hosts, print one line per state change per host and send "
        "notifications to the URLs in the inventory's notify_urls_file. Stops on SIGINT/SIGTERM.",
    )
    sp.add_argument("host", nargs="*", help="hosts or groups (default, or `all`: every host)")
    sp.add_argument(
        "--interval-s", type=float, default=30.0, help="seconds between polls (default 30)"
    )
    sp.add_argument(
        "--burst-s",
        type=float,
        default=30.0,
        help="events are gathered this long before one round of notifications (default 30)",
    )
    sp.add_argument(
        "--drain-s",
        type=float,
        default=10.0,
        help="on stop, wait this long for queued notifications, then abandon them (default 10)",
    )
    sp.add_argument("--no-notify", action="store_true", help="print only, send nothing")
    sp.add_argument("--no-gpu", action="store_true", help="do not query nvidia-smi")
    sp.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="also log failed polls and each notification sent (stderr)",
    )
    sp.set_defaults(func=cmd_watch)
