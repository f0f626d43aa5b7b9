"""`dflashctl hosts`, `trust` and `secret`: the inventory, host keys and container secrets."""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import TYPE_CHECKING

from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.errors import ExitCode, UsageError
from dflashctl.errors import print_error as print_err
from dflashctl.remote.connect import make_transport
from dflashctl.remote.transport import Transport

if TYPE_CHECKING:
    pass


from dflashctl.cli.common import Subparsers, command_adder, inventory, target_of, with_transport


async def cmd_hosts(args: argparse.Namespace) -> int:
    inv = inventory(args)

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
    target = target_of(args)
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
        print_err(
            f"{host.name}: a DIFFERENT key is pinned in {host.known_hosts} "
            f"({pinned[0].get_fingerprint('sha256')}); remove that line by hand if the host "
            f"really was reinstalled"
        )
        return ExitCode.UNREACHABLE  # as every command that meets this key exits (HostKeyError)
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


async def cmd_secret(args: argparse.Namespace) -> int:
    target = target_of(args)
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

    return await with_transport(host, go)


def register(sub: Subparsers) -> None:
    """Adds hosts, trust, secret."""
    add = command_adder(sub)
    sp = add("hosts", cmd_hosts, "list inventory hosts and whether they are reachable", host=False)
    sp.add_argument("--no-check", action="store_true", help="do not connect")
    sp = add("trust", cmd_trust, "fetch a host's SSH key, show its fingerprint, pin it")
    sp.add_argument("--yes", action="store_true", help="pin without asking (scripts)")
    sp = add(
        "secret", cmd_secret, "store a secret (read from stdin) as a 0600 file in the container"
    )
    sp.add_argument("name")
