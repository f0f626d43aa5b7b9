"""`dflashctl` command line: parse arguments, call the services, print, exit with a clear code.

Exit codes are `dflashctl.errors.ExitCode`: 0 ok, 1 operation failed, 2 usage or config error,
3 host unreachable. Errors are raised as `DflashctlError`s and reported by one wrapper,
`dflashctl.errors.run_main`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shlex
import sys
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.config.inventory import GroupConfig, HostConfig, Inventory, load_inventory
from dflashctl.errors import ExitCode, UsageError, run_main
from dflashctl.errors import print_error as _print_err
from dflashctl.remote.connect import attach_argv, make_transport
from dflashctl.remote.transport import Transport

if TYPE_CHECKING:
    from dflashctl.alerts.notify import Notifier
    from dflashctl.groups.control import GroupControl
    from dflashctl.runs.measure import MeasureControl, MeasureState
    from dflashctl.runs.service import StartResult, StopResult
    from dflashctl.runs.snapshot import RunStatus


def _inventory(args: argparse.Namespace) -> Inventory:
    inv = load_inventory(args.hosts)
    for warning in inv.warnings:
        _print_err(f"warning: {warning}")
    return inv


def _host(args: argparse.Namespace) -> HostConfig:
    return _inventory(args).get(args.host)


def _target(args: argparse.Namespace) -> HostConfig | GroupConfig:
    """The host or group `args.host` names (one namespace: load refuses a clash)."""
    return _resolve(_inventory(args), [args.host])[0]


def _resolve(inv: Inventory, names: Sequence[str]) -> list[HostConfig | GroupConfig]:
    """Hosts and groups by name; without groups in the file an unknown name is the plain
    "no host" error (whose message lists the hosts), else one that lists both."""
    if not inv.groups:
        return [inv.get(n) for n in names]
    return inv.resolve_targets(names)


async def _with_group(group: GroupConfig, fn: Callable[[GroupControl], Awaitable[int]]) -> int:
    """Run `fn` over a GroupControl with one transport per node, all closed after."""
    from dflashctl.groups.control import GroupControl

    transports = [make_transport(h) for h in group.nodes]
    try:
        return await fn(GroupControl(group, transports))
    finally:
        await asyncio.gather(*(t.close() for t in transports), return_exceptions=True)


async def _with_transport(host: HostConfig, fn: Callable[[Transport], Awaitable[int]]) -> int:
    transport = make_transport(host)
    try:
        return await fn(transport)
    finally:
        await transport.close()


# --- commands ------------------------------------------------------------------------------


async def cmd_hosts(args: argparse.Namespace) -> int:
    inv = _inventory(args)

    async def probe(host: HostConfig) -> tuple[HostConfig, str]:
        transport = make_transport(host)
        try:
            state = await asyncio.wait_for(transport.container_state(), host.connect_timeout * 2)
            return host, f"reachable, CT {host.ctid} {state}"
        except Exception as err:  # one line per host, whatever went wrong there
            return host, f"UNREACHABLE: {err}" if str(err) else f"UNREACHABLE: {type(err).__name__}"
        finally:
            await transport.close()

    if args.no_check:
        rows = [(h, "-") for h in inv.hosts.values()]
    else:
        rows = await asyncio.gather(*(probe(h) for h in inv.hosts.values()))
    for host, state in rows:
        print(
            f"{host.name:<16} {host.user}@{host.address}:{host.port} ct={host.ctid} "
            f"workdir={host.workdir} session={host.session}  {state}"
        )
    if not rows:
        print(f"(no hosts in {inv.path})")
    if rows and not args.no_check and all(state.startswith("UNREACHABLE") for _, state in rows):
        return ExitCode.UNREACHABLE
    return ExitCode.OK


async def cmd_trust(args: argparse.Namespace) -> int:
    target = _target(args)
    if isinstance(target, GroupConfig):
        codes = [await _trust(args, h) for h in target.nodes]  # one at a time: it may ask
        return max(codes)
    return await _trust(args, target)


async def _trust(args: argparse.Namespace, host: HostConfig) -> int:
    from dflashctl.remote.ssh import fetch_host_key, pin_host_key, pinned_keys

    key = await fetch_host_key(host)
    fp = key.get_fingerprint("sha256")
    pinned = pinned_keys(host.known_hosts, host.address, host.port)
    print(f"{host.name}: {host.address}:{host.port} presents {key.get_algorithm()} key {fp}")
    if any(k.get_fingerprint("sha256") == fp for k in pinned):
        print(f"already pinned in {host.known_hosts}")
        return ExitCode.OK
    if pinned:
        _print_err(
            f"{host.name}: a DIFFERENT key is pinned in {host.known_hosts} "
            f"({pinned[0].get_fingerprint('sha256')}); remove that line by hand if the host "
            f"really was reinstalled"
        )
        return ExitCode.FAILED
    if not args.yes:
        print("Compare with `ssh-keygen -lf /etc/ssh/ssh_host_*_key.pub` on the host.")
        print("Trust this key? [y/N] ", end="", flush=True)
        answer = sys.stdin.readline().strip().lower()
        if answer not in {"y", "yes"}:
            print("not trusted")
            return ExitCode.FAILED
    pin_host_key(host, key)
    print(f"pinned in {host.known_hosts}")
    return ExitCode.OK


async def cmd_deploy(args: argparse.Namespace) -> int:
    from dflashctl.releases.deploy import deploy
    from dflashctl.releases.release import build_release

    target = _target(args)
    if isinstance(target, GroupConfig):
        return await _deploy_group(args, target)
    host = target
    config = Path(args.config) if args.config else host.run_config
    if args.no_memory_check and config is not None:
        print(f"{host.name}: memory checks skipped (--no-memory-check)")

    async def go(t: Transport) -> int:
        release = build_release(Path(args.tree)) if args.tree else None
        res = await deploy(
            t,
            host,
            config=config,
            progress=print,
            release=release,
            fresh=args.fresh,
            break_stale_lock=args.break_lock,
            memory_check=not args.no_memory_check,
        )
        print(res.summary())
        for rel in res.pruned:
            print(f"{host.name}: pruned release {rel}")
        return ExitCode.OK

    return await _with_transport(host, go)


async def _deploy_group(args: argparse.Namespace, group: GroupConfig) -> int:
    """`deploy GROUP`: one release and one run config on every node, at once; a node that
    fails is its one error line, the others are still reported."""
    from dflashctl.groups.control import group_config_path
    from dflashctl.releases.release import build_release

    config = group_config_path(group, Path(args.config) if args.config else None)
    if config is not None:
        from dflashctl.config.runconfig import validate_config

        validate_config(config)  # a bad config fails before any node is touched
    if args.no_memory_check and config is not None:
        print(f"{group.name}: memory checks skipped (--no-memory-check)")
    release = build_release(Path(args.tree)) if args.tree else build_release()

    async def go(gc: GroupControl) -> int:
        outcomes = await gc.deploy(
            config=config,
            release=release,
            progress=print,
            fresh=args.fresh,
            break_stale_lock=args.break_lock,
            memory_check=not args.no_memory_check,
        )
        for o in outcomes:
            if o.result is not None:
                print(o.result.summary())
                for rel in o.result.pruned:
                    print(f"{o.host}: pruned release {rel}")
            else:
                _print_err(o.error_line())
        bad = [o.host for o in outcomes if not o.ok]
        if bad:
            _print_err(
                f"group {group.name!r}: deploy failed on {', '.join(bad)}; the group does not "
                f"start until every node has release {release.id}"
            )
            return ExitCode.FAILED
        cfg = f" and config {config}" if config is not None else ""
        print(f"{group.name}: release {release.id}{cfg} on all {group.nnodes} nodes")
        return ExitCode.OK

    return await _with_group(group, go)


async def cmd_start(args: argparse.Namespace) -> int:
    from dflashctl.runs.control import RunControl

    target = _target(args)
    resume = _resume_choice(args)
    if isinstance(target, GroupConfig):
        return await _start_group(args, target, resume)
    host = target

    async def go(t: Transport) -> int:
        res = await RunControl(t, host).start(
            fresh=args.fresh, resume=resume, wait_s=_wait_s(args, host), progress=print
        )
        for note in [*res.notes, res.supervisor_note()]:
            if note:
                print(f"{host.name}: note: {note}")
        if res.started:
            print(
                f"{host.name}: started release {res.release} in tmux session {host.session!r} "
                f"(pid {res.pane_pid}): {shlex.join(res.argv)}"
            )
            print(_readiness(host.name, res))
        else:
            print(f"{host.name}: already running (release {res.release or '?'})")
        return ExitCode.OK

    return await _with_transport(host, go)


async def _start_group(args: argparse.Namespace, group: GroupConfig, resume: str) -> int:
    wait_s = _wait_s(args, group.nodes[0])

    async def go(gc: GroupControl) -> int:
        res = await gc.start(fresh=args.fresh, resume=resume, wait_s=wait_s, progress=print)
        if not res.started:
            print(f"{group.name}: already running on every node (release {res.release})")
            return ExitCode.OK
        for i, r in enumerate(res.nodes):
            print(
                f"{r.host}: node {i} of {group.name}: started release {r.release} "
                f"(pid {r.pane_pid}): {shlex.join(r.argv)}"
            )
        print(
            f"{group.name}: started on {group.nnodes} nodes (no per-node restarts: a node "
            f"restarted alone cannot rejoin; `dflashctl restart {group.name}` restarts the group)"
        )
        if res.ready is None:
            print(f"{group.name}: not waited for (see `dflashctl status {group.name}`)")
        elif res.ready:
            print(
                f"{group.name}: every rank joined; node 0 is past its setup after {res.waited_s:.0f} s"
            )
        else:
            print(
                f"{group.name}: node 0 still setting up after {res.waited_s:.0f} s; "
                f"`dflashctl status {group.name}` shows how it goes"
            )
        return ExitCode.OK

    return await _with_group(group, go)


def _resume_choice(args: argparse.Namespace) -> str:
    from dflashctl.releases.resume import ResumeChoiceError, validate_resume_choice

    if args.resume is None:
        return "auto"
    if args.fresh:
        raise UsageError("--fresh and --resume exclude each other (--fresh starts over)")
    try:
        return validate_resume_choice(args.resume)
    except ResumeChoiceError as err:
        raise UsageError(str(err)) from None


def _wait_s(args: argparse.Namespace, host: HostConfig) -> float:
    if args.wait_s is None:
        return float(host.start_wait)
    if args.wait_s < 0:
        raise UsageError(f"--wait-s {args.wait_s:g}: must be 0 (do not wait) or more")
    return float(args.wait_s)


def _readiness(name: str, res: StartResult) -> str:
    if res.ready is None:
        return f"{name}: not waited for (see `dflashctl status {name}`)"
    if res.ready:
        return f"{name}: the trainer is past its setup after {res.waited_s:.0f} s"
    return (
        f"{name}: still setting up after {res.waited_s:.0f} s (no phase line yet); "
        f"`dflashctl status {name}` or `logs -f` shows how it goes"
    )


async def cmd_stop(args: argparse.Namespace) -> int:
    from dflashctl.runs.control import RunControl

    target = _target(args)
    if isinstance(target, GroupConfig):
        return await _stop_group(args, target)
    host = target

    async def go(t: Transport) -> int:
        res = await RunControl(t, host).stop(args.timeout)
        print(f"{host.name}: {res.summary()}")
        if not res.was_running:
            return ExitCode.OK
        return ExitCode.OK if res.checkpoint or res.outcome == "exited" else ExitCode.FAILED

    return await _with_transport(host, go)


async def _stop_group(args: argparse.Namespace, group: GroupConfig) -> int:
    async def go(gc: GroupControl) -> int:
        res = await gc.stop(args.timeout)
        for i, r in enumerate(res.nodes):
            print(
                f"{r.host}: node {i}: {r.summary() if i == 0 or r.was_running else _node_exit(r)}"
            )
        node0 = res.nodes[0]
        if not node0.was_running:
            return ExitCode.OK
        return ExitCode.OK if node0.checkpoint or node0.outcome == "exited" else ExitCode.FAILED

    return await _with_group(group, go)


def _node_exit(r: StopResult) -> str:
    if r.exit_status is None:
        return "not running"
    return f"exited with the group (status {r.exit_status})"


async def cmd_restart(args: argparse.Namespace) -> int:
    from dflashctl.releases.release import build_release
    from dflashctl.runs.control import RunControl

    target = _target(args)
    config = Path(args.config) if args.config else None
    resume = _resume_choice(args)
    if isinstance(target, GroupConfig):
        return await _restart_group(args, target, config, resume)
    host = target

    async def go(t: Transport) -> int:
        release = build_release(Path(args.tree)) if args.tree else None
        res = await RunControl(t, host).restart(
            fresh=args.fresh,
            config=config,
            stop_timeout=args.timeout,
            progress=print,
            release=release,
            resume=resume,
            wait_s=_wait_s(args, host),
        )
        if res.config_diff:
            print(res.config_diff, end="" if res.config_diff.endswith("\n") else "\n")
        print(res.deploy.summary())
        ck = (
            f"checkpoint step {res.stop.checkpoint.step}"
            if res.stop.checkpoint
            else "no checkpoint"
        )
        print(f"{host.name}: stop: {res.stop.outcome} ({ck})")
        print(
            f"{host.name}: started release {res.start.release}; config "
            f"{res.old_config_hash or '-'} -> {res.new_config_hash or '-'}"
            f"{' (fresh: old checkpoints archived)' if args.fresh else ''}"
        )
        print(_readiness(host.name, res.start))
        return ExitCode.OK

    return await _with_transport(host, go)


async def _restart_group(
    args: argparse.Namespace, group: GroupConfig, config: Path | None, resume: str
) -> int:
    from dflashctl.groups.control import group_config_path
    from dflashctl.releases.release import build_release

    path = group_config_path(group, config)
    wait_s = _wait_s(args, group.nodes[0])

    async def go(gc: GroupControl) -> int:
        release = build_release(Path(args.tree)) if args.tree else None
        res = await gc.restart(
            fresh=args.fresh,
            config=path,
            stop_timeout=args.timeout,
            progress=print,
            release=release,
            resume=resume,
            wait_s=wait_s,
        )
        for d in res.deploys:
            print(d.summary())
        step = res.stop.checkpoint_step
        print(
            f"{group.name}: stop: {res.stop.nodes[0].outcome} "
            f"({f'checkpoint step {step} on node 0' if step is not None else 'no checkpoint'})"
        )
        print(
            f"{group.name}: started release {res.start.release} on {group.nnodes} nodes; config "
            f"{res.old_config_hash or '-'} -> {res.new_config_hash or '-'}"
            f"{' (fresh: old checkpoints archived)' if args.fresh else ''}"
        )
        return ExitCode.OK

    return await _with_group(group, go)


async def cmd_status(args: argparse.Namespace) -> int:
    """Hosts and groups as named (every host when none is); a group is one entry: its state,
    the node and rank that failed first, and one entry per node (`dflashctl.groups.control`)."""
    from dflashctl.cli.status_text import format_run_status
    from dflashctl.runs.control import RunControl

    inv = _inventory(args)
    targets = _resolve(inv, args.host) if args.host else list(inv.hosts.values())

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
            entries.append(_group_entry(target, got, as_json=args.json))
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


def _group_entry(group: GroupConfig, sts: list[RunStatus], *, as_json: bool) -> object:
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
    for i, st in enumerate(sts):
        node = view.nodes[i]
        ranks = f" ranks {node.rank_range[0]}-{node.rank_range[1] - 1}" if node.rank_range else ""
        lines.append(f"  node {i}{ranks}: " + format_run_status(st).replace("\n", "\n  "))
    return "\n".join(lines)


def _watch_hosts(inv: Inventory, names: Sequence[str]) -> list[HostConfig]:
    """`all` (or nothing) is every host; a group is its nodes; each host once, in order."""
    if not names or "all" in names:
        return list(inv.hosts.values())
    hosts: dict[str, HostConfig] = {}
    for target in inv.resolve_targets(names):
        for h in target.nodes if isinstance(target, GroupConfig) else (target,):
            hosts.setdefault(h.name, h)
    return list(hosts.values())


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
            _print_err(f"{inv.path}: notify_urls_file {line}")
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
    inv = _inventory(args)
    hosts = _watch_hosts(inv, args.host)
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
    print(
        f"dflashctl: watching {', '.join(h.name for h in hosts)} every {args.interval_s:g} s "
        f"(unreachable alert after {inv.unreachable_alert_s:g} s, poll limit "
        f"{max(poll_limit_s(h) for h in hosts):g} s); {where}",
        file=sys.stderr,
        flush=True,
    )

    def emit(line: str) -> None:
        print(line, flush=True)

    try:
        outcome = await run_watch(
            hosts, settings, make_transport=make_transport, notifier=notifier, stop=stop, emit=emit
        )
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
    print(f"dflashctl: {outcome.summary(args.drain_s)}", file=sys.stderr, flush=True)
    return ExitCode.OK


def _print_line(line: str, as_json: bool, prefix: str = "") -> None:
    if as_json:
        from trainer.events import parse_line

        event = parse_line(line).model_dump_json()
        host = prefix.removesuffix("| ")
        # a group's lines: {"host": ..., "event": ...} (the event's own keys stay untouched)
        print(f'{{"host": {json.dumps(host)}, "event": {event}}}' if host else event, flush=True)
    else:
        print(prefix + line, flush=True)


LOG_RESTARTED = "restarted: status.log started over; reading it from its first line"


async def cmd_logs(args: argparse.Namespace) -> int:
    target = _target(args)
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
        st = await ctl.status()
        if st.state == "unreachable":
            from dflashctl.remote.transport import HostUnreachable

            raise HostUnreachable(st.message or host.name)
        start = max(0, st.log_lines - args.lines)
        if not args.follow:
            for line in await ctl.log.log_tail(start):
                _print_line(line, args.json, prefix)
            return ExitCode.OK
        lost = False
        async with contextlib.aclosing(ctl.follow(start)) as events:
            async for event in events:
                if isinstance(event, Line):
                    _print_line(event.text, args.json, prefix)
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

    return await _with_transport(host, go)


async def cmd_attach(args: argparse.Namespace) -> int:
    target = _target(args)
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


async def cmd_buckets(args: argparse.Namespace) -> int:
    target = _target(args)
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
            _print_err(f"{host.name}: planner failed: {res.error_line()}")
            return ExitCode.FAILED
        return ExitCode.OK

    return await _with_transport(host, go)


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

    target = _target(args)
    name = args.host
    if isinstance(target, GroupConfig):
        host = target.nodes[0]
        _say(
            f"{target.name}: measuring on node 0 ({host.name}); its release and config are the group's"
        )
    else:
        host = target
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
            stopped = await mc.stop()
            if stopped is None:
                print(f"{host.name}: no measure is running")
            else:
                from dflashctl.monitor.state import format_age

                ran = stopped.age()
                after = f" after {format_age(ran)}" if ran is not None else ""
                print(f"{host.name}: measure {stopped.measure_id} stopped{after}")
            return ExitCode.OK
        if req is None:
            st = await mc.state(measure_id=args.id)
            return await _measure_outcome(mc, st, args, name, calibration)
        started = await mc.start(req)
        _say(
            f"{host.name}: measure {started.measure_id} started in tmux session "
            f"{started.session!r} (release {started.release}), writing {started.directory}: "
            f"{shlex.join(started.argv)}"
        )
        if args.detach:
            # a refusal comes within moments
            st = await mc.state(0, DETACH_GRACE_S, started.measure_id)
            if st.running:
                _say(
                    f"{host.name}: detached; `dflashctl measure {name} --result` prints the "
                    f"result once it is done (or how far it is), `--stop` ends it"
                )
                return ExitCode.OK
            return await _measure_outcome(mc, st, args, name, calibration)

        def line(text: str) -> None:
            if not text.startswith("error: "):  # the outcome's own line says it once
                _say(f"{host.name}: {text}")

        try:
            st = await mc.follow(
                line, lambda note: _say(f"{host.name}: {note}"), measure_id=started.measure_id
            )
        except asyncio.CancelledError:  # Ctrl-C: this client leaves, the measure does not
            _say(
                f"{host.name}: measure {started.measure_id} goes on in tmux session "
                f"{started.session!r}; `dflashctl measure {name} --result` prints it when "
                f"done, `--stop` ends it"
            )
            raise
        return await _measure_outcome(mc, st, args, name, calibration)

    return await _with_transport(host, go)


def _say(text: str) -> None:
    """A note on stderr (stdout keeps only the result: `measure HOST --json > out.json`)."""
    print(f"dflashctl: {text}", file=sys.stderr, flush=True)


async def _measure_outcome(
    mc: MeasureControl,
    st: MeasureState,
    args: argparse.Namespace,
    name: str,
    calibration: Path | None,
) -> int:
    """Print the newest measure's result (and fetch its calibration), or raise what it is."""
    from dflashctl.runs.measure import MeasureError, MeasureRunning, how_far, iso_utc, outcome_error

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
    _say(
        f"{host}: measure {st.measure_id} (started {iso_utc(started) if started else '?'}, "
        f"release {st.info.get('release', '?')}): {st.directory}"
    )
    print(await mc.result(st, as_json=args.json), flush=True)
    if calibration is not None:
        path = await mc.fetch_calibration(st, calibration)
        _say(f"{host}: calibration saved to {path}")
    return ExitCode.OK


async def cmd_secret(args: argparse.Namespace) -> int:
    target = _target(args)
    data = sys.stdin.buffer.read()
    if not data:
        raise UsageError("secret value is read from stdin, and stdin was empty")
    if isinstance(target, GroupConfig):  # every node gets it (whichever rank reads it)
        codes = [await _secret(args, h, data) for h in target.nodes]
        return max(codes)
    return await _secret(args, target, data)


async def _secret(args: argparse.Namespace, host: HostConfig, data: bytes) -> int:
    from dflashctl.runs.control import RunControl

    async def go(t: Transport) -> int:
        path = await RunControl(t, host).put_secret(args.name, data)
        print(f"{host.name}: wrote {len(data)} bytes to {path} (mode 0600)")
        return ExitCode.OK

    return await _with_transport(host, go)


# --- parser and dispatch -------------------------------------------------------------------


def _add_run_flags(sp: argparse.ArgumentParser) -> None:
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="dflashctl",
        description="Deploy and operate DFlash training runs on Proxmox LXC containers.",
    )
    p.add_argument(
        "--hosts",
        type=Path,
        default=None,
        help="inventory file (default ./hosts.toml, then ~/.config/dflashctl/hosts.toml)",
    )
    sub = p.add_subparsers(dest="command")

    def add(
        name: str, fn: Callable[[argparse.Namespace], Awaitable[int]], help: str, host: bool = True
    ) -> argparse.ArgumentParser:
        sp = sub.add_parser(name, help=help, description=help)
        if host:
            sp.add_argument("host", help="a host, or a group (every node of it)")
        sp.set_defaults(func=fn)
        return sp

    sp = add("hosts", cmd_hosts, "list inventory hosts and whether they are reachable", host=False)
    sp.add_argument("--no-check", action="store_true", help="do not connect")
    sp = add("trust", cmd_trust, "fetch a host's SSH key, show its fingerprint, pin it")
    sp.add_argument("--yes", action="store_true", help="pin without asking (scripts)")
    sp = add("deploy", cmd_deploy, "deploy the trainer (and run config) to a host")
    sp.add_argument("--config", help="run config to push (default: run_config in hosts.toml)")
    sp.add_argument("--tree", help="directory holding the trainer/ to ship (default: installed)")
    sp.add_argument(
        "--fresh",
        action="store_true",
        help="push a config that cannot resume the checkpoints (start --fresh next)",
    )
    sp.add_argument(
        "--break-lock",
        action="store_true",
        help="remove a deploy lock left by a dead deploy (refused while that deploy runs)",
    )
    sp.add_argument(
        "--no-memory-check",
        action="store_true",
        help="skip the memory estimate (GPU fit, checkpoints vs free disk) of the pushed config",
    )
    sp = add("start", cmd_start, "start the trainer in tmux")
    sp.add_argument("--fresh", action="store_true", help="archive checkpoints, start from step 0")
    _add_run_flags(sp)
    sp = add("stop", cmd_stop, "SIGINT the trainer, wait for its checkpoint, end the session")
    sp.add_argument("--timeout", type=float, default=120.0, help="seconds to wait (default 120)")
    sp = add("restart", cmd_restart, "push config, deploy if changed, stop, start")
    sp.add_argument("--fresh", action="store_true", help="archive checkpoints, start from step 0")
    sp.add_argument("--config", help="run config to push (default: run_config in hosts.toml)")
    sp.add_argument("--timeout", type=float, default=120.0, help="stop timeout in seconds")
    sp.add_argument("--tree", help="directory holding the trainer/ to ship (default: installed)")
    _add_run_flags(sp)
    sp = sub.add_parser("status", help="run state, release, config hash, latest status line")
    sp.add_argument("host", nargs="*", help="hosts or groups (default: every host)")
    sp.add_argument("--json", action="store_true")
    sp.set_defaults(func=cmd_status)
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
    sp = add("logs", cmd_logs, "print (or follow with -f) the run's status.log")
    sp.add_argument("-f", "--follow", action="store_true")
    sp.add_argument("-n", "--lines", type=int, default=20)
    sp.add_argument("--json", action="store_true", help="one parsed event per line as JSON")
    sp = add("attach", cmd_attach, "attach to the trainer's tmux session (interactive ssh -t)")
    sp.add_argument("--print", action="store_true", help="print the ssh command instead")
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
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument(
        "--detach", action="store_true", help="start it and return (it runs on in tmux)"
    )
    mode.add_argument(
        "--result",
        action="store_true",
        help="print the newest measure's result, or how far it is while it runs (exit 1)",
    )
    mode.add_argument("--stop", action="store_true", help="end the running measure")
    sp.add_argument(
        "--id",
        metavar="ID",
        help="with --result: that measure (as started prints it, e.g. 20261201T170211Z), not "
        "the newest",
    )
    sp = add(
        "secret", cmd_secret, "store a secret (read from stdin) as a 0600 file in the container"
    )
    sp.add_argument("name")
    sub.add_parser("tui", help="the live fleet TUI (default)").set_defaults(func=None)
    sub.add_parser("demo", help="the TUI against a local demo run").set_defaults(func=None)
    return p


def _run_delegate(command: str, argv: Sequence[str]) -> int:
    if command == "demo":
        from dflashctl import demo

        return int(demo.main(list(argv)) or 0)
    from dflashctl.tui import app

    return int(app.run_app(list(argv)) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    """`dflashctl ...`: every command runs under `run_main` (one error report, one exit code)."""
    return run_main(lambda: _main(list(sys.argv[1:] if argv is None else argv)))


def _main(args_in: list[str]) -> int:
    parser = build_parser()
    # tui/demo own their flags: hand them everything but the subcommand word, untouched.
    i = 0
    while i < len(args_in):
        tok = args_in[i]
        if tok == "--hosts":
            i += 2
        elif tok.startswith("-"):
            i += 1
        elif tok in {"tui", "demo"}:
            return _run_delegate(tok, args_in[:i] + args_in[i + 1 :])
        else:
            break
    args = parser.parse_args(args_in)
    if args.command is None:
        return _run_delegate("tui", args_in)
    return int(asyncio.run(args.func(args)))


if __name__ == "__main__":
    sys.exit(main())
