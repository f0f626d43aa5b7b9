"""What the commands of detached jobs (`measure`, `eval`, `gate`) print alike: the host a group
runs one on, and the lines for a job stopped, started, detached from, or left running."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Sequence
from typing import TYPE_CHECKING

from dflashctl.cli.common import say, target_of
from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.humanize import format_age

if TYPE_CHECKING:
    from dflashctl.runs.detached import DetachedRecord


def add_modes(
    sp: argparse.ArgumentParser,
    word: str,
    *,
    detach: str = "start it and return (runs on in tmux)",
    id_help: str | None = None,
) -> None:
    """--detach, --result, --stop (one at most) and --id, for a job `word` (`measure`)."""
    mode = sp.add_mutually_exclusive_group()
    mode.add_argument("--detach", action="store_true", help=detach)
    mode.add_argument(
        "--result",
        action="store_true",
        help=f"print the newest {word}'s result, or how far it is while it runs (exit 1)",
    )
    mode.add_argument("--stop", action="store_true", help=f"end the running {word}")
    sp.add_argument(
        "--id", metavar="ID", help=id_help or f"with --result: that {word} (e.g. 20261201T170211Z)"
    )


def node0_host(args: argparse.Namespace, word: str) -> HostConfig:
    """The host `args.host` names; a group's node 0, said (`word`: `measuring`)."""
    target = target_of(args)
    if isinstance(target, GroupConfig):
        host = target.nodes[0]
        say(
            f"{target.name}: {word} on node 0 ({host.name}); its release and config are the group's"
        )
        return host
    return target


def print_stopped(host: str, word: str, stopped: DetachedRecord | None) -> None:
    """`--stop`'s line: the job stopped and how long it ran, or that none was running."""
    if stopped is None:
        print(f"{host}: no {word} is running")
        return
    ran = stopped.age()
    after = f" after {format_age(ran)}" if ran is not None else ""
    print(f"{host}: {word} {stopped.record_id} stopped{after}")


def say_started(
    host: str,
    what: str,
    session: str,
    release: str,
    directory: str,
    argv: Sequence[str],
) -> None:
    """`what` (`measure ID`) started: its session, release, directory and command."""
    say(
        f"{host}: {what} started in tmux session {session!r} (release {release}), writing "
        f"{directory}: {shlex.join(argv)}"
    )


def say_detached(host: str, word: str, target: str) -> None:
    """`--detach` left a running job (`target`: the host or group as named)."""
    say(
        f"{host}: detached; `dflashctl {word} {target} --result` prints the result once it is "
        "done (or how far it is), `--stop` ends it"
    )


def say_goes_on(host: str, what: str, session: str, word: str, target: str) -> None:
    """Ctrl-C while following: this client leaves, the job (`what`) does not."""
    say(
        f"{host}: {what} goes on in tmux session {session!r}; `dflashctl {word} {target} "
        "--result` prints it when done, `--stop` ends it"
    )
