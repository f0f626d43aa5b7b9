"""`dflashctl setup HOST|GROUP [--wheelhouse DIR] [--python BASE]`: the trainer's environment
in the container, built from the checkout's requirements.lock (dflashctl.releases.envsetup)."""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path

from dflashctl.cli.common import Subparsers, command_adder, target_of
from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.errors import ExitCode
from dflashctl.errors import print_error as print_err
from dflashctl.remote.connect import make_transport


async def cmd_setup(args: argparse.Namespace) -> int:
    from dflashctl.releases.envsetup import SetupError, env_spec, setup_env

    target = target_of(args)
    hosts: tuple[HostConfig, ...] = target.nodes if isinstance(target, GroupConfig) else (target,)
    spec = env_spec()
    wheelhouse = Path(args.wheelhouse) if args.wheelhouse else None

    async def one(host: HostConfig) -> int:
        transport = make_transport(host)
        try:
            outcome = await setup_env(
                transport,
                host,
                base_python=args.python,
                wheelhouse=wheelhouse,
                spec=spec,
                progress=print,
            )
        except SetupError as err:
            print_err(str(err))
            return ExitCode.FAILED
        finally:
            await transport.close()
        done = "up to date" if outcome == "unchanged" else "env built"
        print(f"{host.name}: setup: {done}: {host.workdir}/env (requirements.lock {spec.lock_sha})")
        return ExitCode.OK

    codes = await asyncio.gather(*(one(h) for h in hosts))
    return max(codes)


def register(sub: Subparsers) -> None:
    """Adds setup."""
    add = command_adder(sub)
    sp = add(
        "setup",
        cmd_setup,
        "build the trainer's venv in the container from requirements.lock (torch's CPU build, "
        "or the CUDA build that matches the driver)",
    )
    sp.add_argument(
        "--wheelhouse",
        metavar="DIR",
        help="push DIR's wheels to the container and install from them only (no package index)",
    )
    sp.add_argument(
        "--python",
        default="python3",
        help="the container's base interpreter that creates the venv (default: python3)",
    )
