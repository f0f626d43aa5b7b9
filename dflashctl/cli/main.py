"""`dflashctl` command line: parse arguments, call the services, print, exit with a clear code.

One module per family of commands (`hosts`, `lifecycle`, `status`, `watch`, `measure`,
`jobs`: eval and gate, `compare`, `regen`), each
registering its subcommands; `common` is what they share. `tui` and `demo` own their flags and
are handed everything but the subcommand word.

Exit codes are `dflashctl.errors.ExitCode`: 0 ok, 1 operation failed, 2 usage or config error,
3 host unreachable. Errors are raised as `DflashctlError`s and reported by one wrapper,
`dflashctl.errors.run_main`.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Sequence
from pathlib import Path

from dflashctl.cli import (
    compare,
    doctor,
    hosts,
    jobs,
    lifecycle,
    measure,
    regen,
    setup,
    status,
    watch,
)
from dflashctl.errors import run_main


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
    for family in (hosts, lifecycle, status, watch, measure, jobs, compare, regen, doctor, setup):
        family.register(sub)
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
