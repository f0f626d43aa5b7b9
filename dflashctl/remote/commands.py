"""What every remote action is made of: the clean environment, one quoting layer, the node-side
bound and the stdin guards, the supervisor's argv, and `describe` (a command in words).

Every remote action is an argv list built under dflashctl.remote, grouped by what it drives:
`pct`, `tmux`, `files`, `run` (the run's status round trip and waits), `release` (the deploy
steps) and `probe` (the python probes), with every path from `layout`. Services only order the
steps and parse the output. The pct, tmux and files builders are also importable from here
(the names callers have always used). Container
argvs are wrapped by `pct_exec` and joined once with `shlex.join` for the Proxmox host's login
shell; variable data inside `sh -c` scripts travels as positional parameters ("$1"), never
interpolated into the script text.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence

from dflashctl.remote.files import line_count, read_file, tail_follow, tail_from, write_file_atomic
from dflashctl.remote.layout import SUPERVISOR_SOURCE
from dflashctl.remote.pct import parse_pct_status, pct_config, pct_exec, pct_push, pct_status
from dflashctl.remote.tmux import (
    FALLBACK_TERM,
    HISTORY_LIMIT,
    KNOWN_TERM_SCRIPT,
    PANE_FORMAT,
    PANE_HEIGHT,
    PANE_WIDTH,
    SETTLED_PANE_FN,
    TMUX_SOCKET,
    PaneState,
    parse_pane_state,
    tmux,
    tmux_attach,
    tmux_capture,
    tmux_has_session,
    tmux_interrupt,
    tmux_kill_session,
    tmux_literal,
    tmux_new_session,
    tmux_settled_pane_state,
    with_known_term,
)

__all__ = [
    "BASE_ENV",
    "CONTAINER_PATH",
    "FALLBACK_TERM",
    "GUARD_SCRIPT",
    "HISTORY_LIMIT",
    "KILL_AFTER_S",
    "KNOWN_TERM_SCRIPT",
    "NODE_GUARD_SCRIPT",
    "PANE_FORMAT",
    "PANE_HEIGHT",
    "PANE_WIDTH",
    "SCRIPT_WORDS",
    "SETTLED_PANE_FN",
    "SUPERVISOR_FILE",
    "SUPERVISOR_MODULE",
    "TIMED_OUT_RCS",
    "TMUX_SOCKET",
    "PaneState",
    "bounded",
    "clean_env",
    "describe",
    "guarded",
    "line_count",
    "node_guarded",
    "parse_pane_state",
    "parse_pct_status",
    "pct_config",
    "pct_exec",
    "pct_push",
    "pct_status",
    "read_file",
    "shell_join",
    "supervised",
    "tail_follow",
    "tail_from",
    "tmux",
    "tmux_attach",
    "tmux_capture",
    "tmux_has_session",
    "tmux_interrupt",
    "tmux_kill_session",
    "tmux_literal",
    "tmux_new_session",
    "tmux_settled_pane_state",
    "with_known_term",
    "write_file_atomic",
]

# A clean, explicit environment inside the container: `pct exec` carries the SSH session's
# environment over by default (--keep-env), which differs between PVE versions.
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_ENV = {"PATH": CONTAINER_PATH, "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}


def shell_join(argv: Sequence[str]) -> str:
    """Quote an argv once for a POSIX shell (the Proxmox host's login shell)."""
    return shlex.join([str(a) for a in argv])


def clean_env(argv: Sequence[str], extra: Mapping[str, str] | None = None) -> list[str]:
    """Run argv under `env -i` with BASE_ENV plus `extra`: nothing leaks in from the SSH side."""
    env = dict(BASE_ENV)
    env.update(extra or {})
    return ["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv]


# --- the remote-side bound -----------------------------------------------------------------

# Seconds between the TERM and the KILL that `timeout` sends to a command past its limit.
KILL_AFTER_S = 3


def _seconds(value: float) -> str:
    """`timeout`'s DURATION: plain digits (never an exponent), at most millisecond precision."""
    text = f"{max(value, 0.001):.3f}".rstrip("0").rstrip(".")
    return text or "0.001"


def bounded(argv: Sequence[str], seconds: float, *, watch_channel: bool = False) -> list[str]:
    """Run argv on the node under coreutils `timeout`: the node itself ends it past `seconds`.

    Closing an SSH channel does not end the command behind it (sshd keeps the session, and its
    MaxSessions slot, until the command exits), and sshd refuses `signal` requests without
    privilege separation, so the bound has to live on the node. `timeout` leads its own process
    group and signals the whole group, which includes `pct exec`'s `lxc-attach` and the
    command attached in the container (TERM, then KILL after KILL_AFTER_S). Exit status 124
    (or 137 after the KILL) then means "timed out".

    `watch_channel` (for commands given no input) also runs it under the stdin guard on the
    node: its stdin is /dev/null, and when the channel closes (the caller gave up or was
    cancelled) the guard signals `timeout`, so an abandoned command ends at once rather than
    at its bound.
    """
    argv = ["timeout", "-k", str(KILL_AFTER_S), _seconds(seconds), *argv]
    return ["sh", "-c", GUARD_SCRIPT, "dflash-node-guard", *argv] if watch_channel else argv


TIMED_OUT_RCS = frozenset({124, 137})


# --- the in-container supervisor ----------------------------------------------------------

SUPERVISOR_MODULE = "trainer.supervise"
SUPERVISOR_FILE = SUPERVISOR_SOURCE  # in a release: a tree deployed before it has none


def supervised(python: str, policy_args: Sequence[str], trainer: Sequence[str]) -> list[str]:
    """`python -m trainer.supervise [policy flags] -- TRAINER_ARGV`: the pane's process.

    The supervisor runs the trainer as its child in the container, so a crash is restarted by
    the host's policy with no operator (and no link) needed; Ctrl-C in the pane reaches it and
    it forwards the signal to the trainer once.
    """
    return [python, "-m", SUPERVISOR_MODULE, *policy_args, "--", *trainer]


# When the command is `timeout` (it leads its own process group, pgid = its pid) the watcher
# signals that whole group, and once the command has exited the script KILLs whatever is left
# of it. Signalling only timeout's pid left the child running (reparented to init) in 79 of 300
# commands abandoned at once under load: an early TERM can end `timeout` before it passes the
# signal on. A pid stays allocated while its process group has members, so `-$p` never names
# another group. For a command that is not a group leader `kill -$p` fails and `kill $p` is
# used. No `--` before the pid: dash's kill takes it for a pid and kills nothing.
_REAP_GROUP = 'wait "$p"; r=$?; kill -KILL -"$p" 2>/dev/null; exit $r'
_KILL_GROUP = 'kill -TERM -"$p" 2>/dev/null || kill -TERM "$p" 2>/dev/null'
GUARD_SCRIPT = (
    'exec 3<&0; "$@" </dev/null & p=$!; '
    f"{{ cat <&3 >/dev/null; {_KILL_GROUP}; }} >/dev/null 2>&1 3<&3 & "
    f"{_REAP_GROUP}"
)


def guarded(argv: Sequence[str]) -> list[str]:
    """Run a long-lived helper that dies when our stdin closes.

    Closing an SSH channel (or losing the link) closes the remote command's stdin, through
    `pct exec` and `lxc-attach` alike; the watcher then kills the helper, so an interrupted
    `logs -f` leaves no `tail -F` behind in the container.
    """
    return ["sh", "-c", GUARD_SCRIPT, "dflash-guard", *argv]


# The node-side counterpart for streams, which cannot be bounded in time: the command keeps the
# channel as its stdin (the container-side guard needs it), and a watcher on the same stdin
# signals `timeout 0` (no time limit, but it leads its own process group and passes a TERM on
# to all of it) once the channel closes. So a `pct` that hangs before it attaches dies with the
# channel too, not only the helper in the container.
NODE_GUARD_SCRIPT = (
    'exec 3<&0; "$@" <&3 & p=$!; '
    f"{{ cat <&3 >/dev/null; {_KILL_GROUP}; }} >/dev/null 2>&1 3<&3 & "
    f"{_REAP_GROUP}"
)


def node_guarded(node_argv: Sequence[str]) -> list[str]:
    """Run a long-lived node command (a `pct exec` stream) that ends when the channel closes."""
    return ["sh", "-c", NODE_GUARD_SCRIPT, "dflash-node-stream", "timeout", "0", *node_argv]


# --- what a command is, in words (for timeout and link-loss messages) -----------------------

# `sh -c SCRIPT dflash-NAME ...`: the $0 names dflashctl gives its scripts.
SCRIPT_WORDS = {
    "dflash-status": "status",
    "dflash-pane": "the tmux pane query",
    "dflash-stop": "waiting for the trainer to stop",
    "dflash-write": "writing {1}",
    "dflash-lock": "the deploy lock and preflight",
    "dflash-unlock": "releasing the deploy lock",
    "dflash-unpack": "unpacking the release",
    "dflash-switch": "switching to the release",
    "dflash-guard": "the log stream",
    "dflash-start-wait": "waiting for the trainer's setup",
    "dflash-term": "attach",
}
_FILE_WORDS = {"cat": "reading {}", "tail": "reading {}", "wc": "counting the lines of {}"}


def describe(argv: Sequence[str]) -> str:
    """The operation an argv performs, in a few words: `status`, `reading /srv/x/run/a.log`."""
    args = [str(a) for a in argv]
    if args[:2] == ["sh", "-c"] and args[3:4] in (["dflash-node-stream"], ["dflash-node-guard"]):
        args = args[4:]
    if args[:2] == ["timeout", "0"]:
        args = args[2:]
    if args[:1] == ["timeout"] and len(args) > 4:
        args = args[4:]
    if not args:
        return "a command"
    prog = args[0].rsplit("/", 1)[-1]
    if prog == "sh" and len(args) >= 4 and args[1] == "-c":
        words = SCRIPT_WORDS.get(args[3])
        if words is not None:
            return words.format(*args[3:], *([""] * 2))
        return f"the {args[3]} script"
    if prog == "tmux":
        sub = [a for a in args[1:] if a.endswith("-session") or a in {"send-keys", "capture-pane"}]
        return f"tmux {sub[-1]}" if sub else "tmux"
    if prog == "pct" and len(args) >= 3:
        return f"pct {args[1]} {args[2]}"
    if prog in _FILE_WORDS and args[-1].startswith("/"):
        return _FILE_WORDS[prog].format(args[-1])
    if prog.startswith("python") and args[1:2] == ["-c"] and len(args) > 2:
        from dflashctl.remote.probe import PROBE_SCRIPT

        return "preflight" if args[2] == PROBE_SCRIPT else f"the {prog} script"
    return prog
