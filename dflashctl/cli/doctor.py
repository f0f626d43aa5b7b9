"""`dflashctl doctor HOST|GROUP [--quick] [--json]`: one line per check (ok, warn, fail) with
the exact fix under each failure (dflashctl.doctor)."""

from __future__ import annotations

import argparse
import asyncio
import json
from dataclasses import asdict

from dflashctl.cli.common import Subparsers, command_adder, target_of
from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.doctor.checks import Check
from dflashctl.errors import ExitCode
from dflashctl.remote.connect import make_transport


def format_check(host: str, c: Check) -> list[str]:
    lines = [f"{host:<12} {c.name:<10} {c.status:<7} {c.detail}"]
    lines += [f"{'':<12} {'':<10} fix:    {line}" for line in c.fix]
    return lines


async def cmd_doctor(args: argparse.Namespace) -> int:
    from dflashctl.doctor.group import check_ifname, check_infiniband, check_ports
    from dflashctl.doctor.run import full_checks, quick_checks

    target = target_of(args)
    hosts: tuple[HostConfig, ...] = target.nodes if isinstance(target, GroupConfig) else (target,)
    transports = [make_transport(h) for h in hosts]
    run = quick_checks if args.quick else full_checks
    try:
        reports = await asyncio.gather(*(run(t, h) for t, h in zip(transports, hosts, strict=True)))
        rows: list[tuple[str, Check]] = [(r.host, c) for r in reports for c in r.checks]
        if isinstance(target, GroupConfig):
            for host, rep in zip(hosts, reports, strict=True):
                if rep.container is not None:
                    rows.append((host.name, check_ifname(host, rep.container)))
                    rows.append((host.name, check_infiniband(host, rep.container)))
            if all(r.container is not None for r in reports):
                rows += [(target.name, c) for c in await check_ports(target, transports)]
    finally:
        await asyncio.gather(*(t.close() for t in transports), return_exceptions=True)
    failed = [f"{h} {c.name}" for h, c in rows if c.status == "fail"]
    if args.json:
        out = [{"host": h, **asdict(c), "fix": list(c.fix)} for h, c in rows]
        print(json.dumps({"ok": not failed, "failed": failed, "checks": out}, indent=2))
    else:
        for h, c in rows:
            print("\n".join(format_check(h, c)))
        print(f"doctor: FAILED: {', '.join(failed)}" if failed else "doctor: ok")
    return ExitCode.FAILED if failed else ExitCode.OK


def register(sub: Subparsers) -> None:
    """Adds doctor."""
    add = command_adder(sub)
    sp = add(
        "doctor",
        cmd_doctor,
        "check a host's (or group's) GPU passthrough, driver, torch, limits and devices",
    )
    sp.add_argument(
        "--quick",
        action="store_true",
        help="only the quick checks deploy and start run (no disk estimate, no self-test)",
    )
    sp.add_argument("--json", action="store_true", help="the checks as one JSON object")
