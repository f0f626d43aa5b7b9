"""`dflashctl deploy`, `start`, `stop` and `restart`, for a host or a group (every node)."""

from __future__ import annotations

import argparse
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.doctor.cache import ensure_quick_checks
from dflashctl.errors import ExitCode
from dflashctl.errors import print_error as print_err
from dflashctl.remote.transport import Transport

if TYPE_CHECKING:
    from dflashctl.groups.control import GroupControl
    from dflashctl.runs.service import StopResult


from dflashctl.cli.common import (
    Subparsers,
    add_run_flags,
    command_adder,
    readiness,
    resume_choice,
    target_of,
    wait_s_of,
    with_group,
    with_transport,
)


async def cmd_deploy(args: argparse.Namespace) -> int:
    from dflashctl.releases.deploy import deploy
    from dflashctl.releases.release import build_release

    target = target_of(args)
    if isinstance(target, GroupConfig):
        return await _deploy_group(args, target)
    host = target
    config = Path(args.config) if args.config else host.run_config
    if args.no_memory_check and config is not None:
        print(f"{host.name}: memory checks skipped (--no-memory-check)")

    if config is not None:  # a bad config is exit 2 before anything connects
        from dflashctl.config.runconfig import validate_config

        validate_config(config)

    async def go(t: Transport) -> int:
        release = build_release(Path(args.tree)) if args.tree else build_release()
        if not args.no_doctor:
            await ensure_quick_checks(t, host, release.id, config, print)
        await _env_note(t, host)
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

    return await with_transport(host, go)


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
        if not args.no_doctor:
            await _group_doctor(gc, release.id, config)
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
                print_err(o.error_line())
        bad = [o.host for o in outcomes if not o.ok]
        if bad:
            print_err(
                f"group {group.name!r}: deploy failed on {', '.join(bad)}; the group does not "
                f"start until every node has release {release.id}"
            )
            return ExitCode.FAILED
        cfg = f" and config {config}" if config is not None else ""
        print(f"{group.name}: release {release.id}{cfg} on all {group.nnodes} nodes")
        return ExitCode.OK

    return await with_group(group, go)


async def _env_note(t: Transport, host: HostConfig) -> None:
    """Say when the container's env (dflashctl setup) is older than the lock, or missing."""
    from dflashctl.errors import UsageError
    from dflashctl.releases.envsetup import env_note, env_spec

    try:
        note = await env_note(t, host, env_spec())
    except UsageError:
        return  # no checkout with a lock next to the trainer: nothing to compare with
    if note:
        print(f"{note}")


async def _group_doctor(gc: GroupControl, release: str | None, config: Path | None) -> None:
    """Every node's quick checks (at once); the first refusal names its node, check and fix.
    A node that cannot be reached is left to the command itself, which names it per node."""
    import asyncio

    from dflashctl.doctor.cache import DoctorRefused
    from dflashctl.remote.transport import TransportError

    got = await asyncio.gather(
        *(ensure_quick_checks(c.transport, c.host, release, config, print) for c in gc.controls),
        return_exceptions=True,
    )
    refused = [g for g in got if isinstance(g, DoctorRefused)]
    if refused:
        raise DoctorRefused("\n".join(str(r) for r in refused))
    for g in got:
        if isinstance(g, BaseException) and not isinstance(g, TransportError):
            raise g


async def _gate_before_start(t: Transport, host: HostConfig) -> None:
    """`gate = "before-start"`: the one-sample overfit gate on what start is about to run,
    unless it passed on this release and config already; a failure refuses the start with the
    gate's line."""
    if host.gate != "before-start":
        return
    from dflashctl.jobs.gate import GateJob

    await GateJob(t, host).ensure(print, lambda line: print(f"{host.name}: gate: {line}"))


async def cmd_start(args: argparse.Namespace) -> int:
    from dflashctl.runs.control import RunControl
    from dflashctl.runs.service import LIVE_STATES

    target = target_of(args)
    resume = resume_choice(args)
    if isinstance(target, GroupConfig):
        return await _start_group(args, target, resume)
    host = target
    wait_s = wait_s_of(args, host)  # a bad value is exit 2 before anything connects

    async def go(t: Transport) -> int:
        # the run's status first: a live run makes start a no-op (no doctor, no gate), and a
        # host that cannot answer is start's failure, named for it
        ctl = RunControl(t, host)
        if (await ctl.reader.status_for("start")).state not in LIVE_STATES:
            if not args.no_doctor:
                await ensure_quick_checks(t, host, None, host.run_config, print)
            if not args.no_gate:
                await _gate_before_start(t, host)
        res = await ctl.start(fresh=args.fresh, resume=resume, wait_s=wait_s, progress=print)
        for note in [*res.notes, res.supervisor_note()]:
            if note:
                print(f"{host.name}: note: {note}")
        if res.started:
            print(
                f"{host.name}: started release {res.release} in tmux session {host.session!r} "
                f"(pid {res.pane_pid}): {shlex.join(res.argv)}"
            )
            print(readiness(host.name, res))
        else:
            print(f"{host.name}: already running (release {res.release or '?'})")
        return ExitCode.OK

    return await with_transport(host, go)


async def _start_group(args: argparse.Namespace, group: GroupConfig, resume: str) -> int:
    wait_s = wait_s_of(args, group.nodes[0])

    async def go(gc: GroupControl) -> int:
        if not args.no_doctor:
            await _group_doctor(gc, None, group.nodes[0].run_config)
        if not args.no_gate:  # node 0's setting; its release and config are the group's
            await _gate_before_start(gc.controls[0].transport, group.nodes[0])
        res = await gc.start(fresh=args.fresh, resume=resume, wait_s=wait_s, progress=print)
        if not res.started:
            print(f"{group.name}: already running on every node (release {res.release})")
            return ExitCode.OK
        for i, r in enumerate(res.nodes):
            print(
                f"{r.host}: node {i} of {group.name}: started release {r.release} "
                f"(pid {r.pane_pid}): {shlex.join(r.argv)}"
            )
        p = group.supervisor_policy()
        print(
            f"{group.name}: started on {group.nnodes} nodes, each under its supervisor: a failed "
            f"rank restarts the whole group from node 0's newest checkpoint, at most "
            f"{p.max_restarts} times within {p.restart_window_s:g} s (restart = {p.restart})"
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

    return await with_group(group, go)


async def cmd_stop(args: argparse.Namespace) -> int:
    from dflashctl.runs.control import RunControl

    target = target_of(args)
    if isinstance(target, GroupConfig):
        return await _stop_group(args, target)
    host = target

    async def go(t: Transport) -> int:
        res = await RunControl(t, host).stop(args.timeout)
        print(f"{host.name}: {res.summary()}")
        return ExitCode.OK if res.saved else ExitCode.FAILED

    return await with_transport(host, go)


async def _stop_group(args: argparse.Namespace, group: GroupConfig) -> int:
    async def go(gc: GroupControl) -> int:
        res = await gc.stop(args.timeout)
        for i, r in enumerate(res.nodes):
            print(
                f"{r.host}: node {i}: {r.summary() if i == 0 or r.was_running else _node_exit(r)}"
            )
        return ExitCode.OK if res.nodes[0].saved else ExitCode.FAILED  # node 0 writes them

    return await with_group(group, go)


def _node_exit(r: StopResult) -> str:
    if r.exit_status is None:
        return "not running"
    return f"exited with the group (status {r.exit_status})"


async def cmd_restart(args: argparse.Namespace) -> int:
    from dflashctl.releases.release import build_release
    from dflashctl.runs.control import RunControl

    target = target_of(args)
    config = Path(args.config) if args.config else None
    resume = resume_choice(args)
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
            wait_s=wait_s_of(args, host),
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
        print(readiness(host.name, res.start))
        return ExitCode.OK

    return await with_transport(host, go)


async def _restart_group(
    args: argparse.Namespace, group: GroupConfig, config: Path | None, resume: str
) -> int:
    from dflashctl.groups.control import group_config_path
    from dflashctl.releases.release import build_release

    path = group_config_path(group, config)
    wait_s = wait_s_of(args, group.nodes[0])

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

    return await with_group(group, go)


def _no_doctor(sp: argparse.ArgumentParser) -> None:
    sp.add_argument(
        "--no-doctor",
        action="store_true",
        help="skip the quick checks (GPU passthrough, driver, torch, limits) otherwise run once "
        "per release and container",
    )


def register(sub: Subparsers) -> None:
    """Adds deploy, start, stop, restart."""
    add = command_adder(sub)
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
    _no_doctor(sp)
    sp = add("start", cmd_start, "start the trainer in tmux")
    sp.add_argument("--fresh", action="store_true", help="archive checkpoints, start from step 0")
    add_run_flags(sp)
    _no_doctor(sp)
    sp.add_argument(
        "--no-gate",
        action="store_true",
        help='skip the overfit gate that gate = "before-start" in hosts.toml runs (once per '
        "release and config)",
    )
    sp = add("stop", cmd_stop, "SIGINT the trainer, wait for its checkpoint, end the session")
    sp.add_argument("--timeout", type=float, default=120.0, help="seconds to wait (default 120)")
    sp = add("restart", cmd_restart, "push config, deploy if changed, stop, start")
    sp.add_argument("--fresh", action="store_true", help="archive checkpoints, start from step 0")
    sp.add_argument("--config", help="run config to push (default: run_config in hosts.toml)")
    sp.add_argument("--timeout", type=float, default=120.0, help="stop timeout in seconds")
    sp.add_argument("--tree", help="directory holding the trainer/ to ship (default: installed)")
    add_run_flags(sp)
