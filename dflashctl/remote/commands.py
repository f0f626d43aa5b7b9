"""Pure argv builders and output parsers for what every remote action is made of: pct, tmux,
files, the supervisor's argv, the stdin guards, and `describe` (a command in words).

Every remote action is an argv list built under dflashctl.remote: here, in `run` (the run's
status round trip and waits), `release` (the deploy steps) and `probe` (the python probes),
with every path from `layout`. Services only order the steps and parse the output. Container
argvs are wrapped by `pct_exec` and joined once with `shlex.join` for the Proxmox host's login
shell; variable data inside `sh -c` scripts travels as positional parameters ("$1"), never
interpolated into the script text.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from dflashctl.remote.layout import SUPERVISOR_SOURCE

TMUX_SOCKET = "dflash"
# A clean, explicit environment inside the container: `pct exec` carries the SSH session's
# environment over by default (--keep-env), which differs between PVE versions.
CONTAINER_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BASE_ENV = {"PATH": CONTAINER_PATH, "HOME": "/root", "LANG": "C.UTF-8", "LC_ALL": "C.UTF-8"}
PANE_WIDTH = 250
PANE_HEIGHT = 50
HISTORY_LIMIT = 20_000


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


def pct_exec(ctid: int, argv: Sequence[str]) -> list[str]:
    """`pct exec CTID -- argv` ('--' so pct never parses the inner command's options)."""
    return ["pct", "exec", str(int(ctid)), "--", *argv]


def pct_status(ctid: int) -> list[str]:
    return ["pct", "status", str(int(ctid))]


def pct_push(ctid: int, src: str, dst: str) -> list[str]:
    return ["pct", "push", str(int(ctid)), src, dst]


def parse_pct_status(stdout: str) -> str:
    """`status: running` -> "running"; anything unrecognised -> "unknown"."""
    for line in stdout.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "status" and value.strip():
            return value.strip()
    return "unknown"


# --- tmux (private socket, exact-match targets) -------------------------------------------


def _session_target(session: str) -> str:
    return f"={session}"


def _pane_target(session: str) -> str:
    # `=NAME:` is window-relative: the session's current window and active pane.
    return f"={session}:"


def tmux_literal(arg: str) -> str:
    """An argument tmux passes on unchanged.

    Given as argv, tmux treats an argument *ending* in ';' as the end of a command (the ';' is
    dropped and the rest starts a new command), and turns a trailing '\\;' into a literal ';'.
    So a trailing ';' gets a backslash before it; nothing else in an argv element is special
    to tmux (`-e` values and multi-argument commands are not format-expanded).
    """
    return arg[:-1] + "\\;" if arg.endswith(";") else arg


def tmux(*args: str) -> list[str]:
    return ["tmux", "-L", TMUX_SOCKET, *args]


def tmux_has_session(session: str) -> list[str]:
    return tmux("has-session", "-t", _session_target(session))


def tmux_new_session(
    session: str,
    command: Sequence[str],
    *,
    cwd: str,
    env: Mapping[str, str],
    width: int = PANE_WIDTH,
    height: int = PANE_HEIGHT,
) -> list[str]:
    """Start a detached session running `command` directly (multi-arg form: no shell).

    Options are set in the same tmux command sequence before the session exists, so a trainer
    that dies at once still leaves a dead pane with its exit status (remain-on-exit), and the
    pane's scrollback is large enough to keep a traceback. Every value (names, paths, env
    values, the command's arguments) goes through `tmux_literal`, so none can end the command.
    """
    env_args: list[str] = []
    for key, value in env.items():
        env_args += ["-e", tmux_literal(f"{key}={value}")]
    return tmux(
        "start-server",
        ";",
        "set-option",
        "-g",
        "remain-on-exit",
        "on",
        ";",
        "set-option",
        "-g",
        "history-limit",
        str(HISTORY_LIMIT),
        ";",
        "new-session",
        "-d",
        "-s",
        tmux_literal(session),
        "-x",
        str(width),
        "-y",
        str(height),
        "-c",
        tmux_literal(cwd),
        *env_args,
        *(tmux_literal(a) for a in command),
    )


def tmux_interrupt(session: str) -> list[str]:
    """Send Ctrl-C to the pane: the trainer checkpoints on SIGINT."""
    return tmux("send-keys", "-t", _pane_target(session), "C-c")


def tmux_kill_session(session: str) -> list[str]:
    return tmux("kill-session", "-t", _session_target(session))


PANE_FORMAT = "#{pane_dead}|#{pane_dead_status}|#{pane_dead_signal}|#{pane_pid}"


# `settled_pane SESSION` prints the pane's PANE_FORMAT line (nothing without the session) once it
# is settled. A pane whose pty just closed reads dead before tmux has reaped its exit status, so
# it asks again for up to 1 s. And tmux links libutempter, whose helper briefly takes over SIGCHLD
# when a pane's pty closes: a pane process exiting in that instant is never reaped
# (tmux/tmux#311), so the pane reads dead with no status for good and the process stays a
# zombie. The first such answer therefore sends the server a SIGCHLD, which makes it run its
# waitpid loop again (harmless when nothing is waiting).
SETTLED_PANE_FN = (
    "settled_pane() { i=0; while :; do "
    f'p=$(tmux -L {TMUX_SOCKET} display-message -p -t "=$1:" "{PANE_FORMAT}" 2>/dev/null); '
    'case "$p" in "1|||"*) [ $i -lt 10 ] || break; [ $i -gt 0 ] || kill -CHLD '
    f'"$(tmux -L {TMUX_SOCKET} display-message -p -t "=$1:" "#{{pid}}")" 2>/dev/null; '
    'i=$((i+1)); sleep 0.1;; *) break;; esac; done; echo "$p"; }\n'
)


def tmux_settled_pane_state(session: str) -> list[str]:
    """The pane's PANE_FORMAT line once tmux has its exit status (see SETTLED_PANE_FN)."""
    return ["sh", "-c", SETTLED_PANE_FN + 'settled_pane "$1"', "dflash-pane", session]


def tmux_capture(session: str, lines: int = 200) -> list[str]:
    """Last `lines` of the pane including scrollback, wrapped lines joined (-J)."""
    return tmux("capture-pane", "-p", "-J", "-t", _pane_target(session), "-S", f"-{int(lines)}")


def tmux_attach(session: str) -> list[str]:
    return tmux("attach-session", "-t", _session_target(session))


# tmux refuses a terminal the container has no terminfo entry for ("missing or unsuitable
# terminal: xterm-kitty"); any modern terminal renders xterm-256color, which ncurses-base ships.
FALLBACK_TERM = "xterm-256color"
KNOWN_TERM_SCRIPT = (
    f'infocmp "$TERM" >/dev/null 2>&1 || TERM={FALLBACK_TERM}; export TERM; exec "$@"'
)


def with_known_term(argv: Sequence[str]) -> list[str]:
    """Run argv with $TERM, or FALLBACK_TERM when the container cannot describe $TERM."""
    return ["sh", "-c", KNOWN_TERM_SCRIPT, "dflash-term", *argv]


@dataclass(frozen=True)
class PaneState:
    dead: bool
    exit_status: int | None  # a signal death reads as 128 + signal, like a shell's $?
    pid: int | None


def parse_pane_state(stdout: str) -> PaneState | None:
    """Parse PANE_FORMAT output; None when it is not there (no session)."""
    line = stdout.strip().splitlines()[-1] if stdout.strip() else ""
    parts = line.split("|")
    if len(parts) != 4 or parts[0] not in {"0", "1"}:
        return None

    def num(s: str) -> int | None:
        return int(s) if re.fullmatch(r"-?\d+", s) else None

    status, signal = num(parts[1]), num(parts[2])
    if status is None and signal is not None:
        status = 128 + signal
    return PaneState(dead=parts[0] == "1", exit_status=status, pid=num(parts[3]))


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


# --- files ---------------------------------------------------------------------------------


def tail_from(path: str, from_line: int = 0) -> list[str]:
    """`path` from 0-based line `from_line` to its end (one read)."""
    return ["tail", "-n", f"+{int(from_line) + 1}", path]


def line_count(path: str) -> list[str]:
    """`wc -l PATH`: prints `N PATH`."""
    return ["wc", "-l", path]


def tail_follow(path: str, from_line: int = 0) -> list[str]:
    """Stream `path` from 0-based line `from_line` on, following it by name across rotation."""
    return ["tail", "-n", f"+{int(from_line) + 1}", "-F", path]


def write_file_atomic(path: str, mode: str = "644") -> list[str]:
    """Write stdin to `path` via a temp file + rename: readers never see a half-written file."""
    script = (
        'set -e; umask 077; mkdir -p "$(dirname "$1")"; tmp="$1.tmp.$$"; '
        'cat > "$tmp"; chmod "$2" "$tmp"; mv -f "$tmp" "$1"'
    )
    return ["sh", "-c", script, "dflash-write", path, mode]


def read_file(path: str) -> list[str]:
    return ["cat", "--", path]


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
