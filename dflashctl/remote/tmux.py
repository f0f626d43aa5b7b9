"""Pure argv builders for tmux in the container (the private `-L dflash` socket, exact-match
targets) and the parser of its pane state. Every value reaches tmux through `tmux_literal`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

TMUX_SOCKET = "dflash"
PANE_WIDTH = 250
PANE_HEIGHT = 50
HISTORY_LIMIT = 20_000


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
