"""The one error base of dflashctl, and the exit codes every command ends with.

Every error a user can cause (a bad inventory key, an unreachable host, a refused resume) is a
`DflashctlError`: its message is one line naming the file, key, line or host; `hint` (optional)
says what to do about it; `exit_code` is what the CLI exits with. `cli.main` and `demo.main`
catch this one class, through `run_main` below (the one entry-point wrapper), never a list of
unrelated ones.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from enum import IntEnum


class ExitCode(IntEnum):
    """What `dflashctl` exits with (documented in docs/dflashctl.md)."""

    OK = 0
    FAILED = 1  # the command ran and the thing it drives failed (deploy, start, a remote step)
    USAGE = 2  # the user's input is wrong (arguments, inventory, config, a refused choice)
    UNREACHABLE = 3  # a host could not be reached (connect, auth, host key)
    INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C (130, as a shell reports it)
    TERMINATED = 128 + signal.SIGTERM  # SIGTERM, where it is handled (the demo: 143)
    BROKEN_PIPE = 128 + signal.SIGPIPE  # the reader left (`dflashctl status | head -1`)


class DflashctlError(Exception):
    """Base of every error dflashctl reports to the user (one line, plus an optional hint)."""

    exit_code: ExitCode = ExitCode.FAILED

    def __init__(self, message: str = "", *, hint: str | None = None) -> None:
        super().__init__(message)
        self.hint = hint

    def one_line(self) -> str:
        """The message, then the hint after `; ` when there is one."""
        text = str(self)
        return f"{text} (hint: {self.hint})" if self.hint else text


class UsageError(DflashctlError):
    """Bad arguments or input the user can fix (exit 2)."""

    exit_code = ExitCode.USAGE


def print_error(message: str, prog: str = "dflashctl") -> None:
    """Every error line goes out here; remote text in it (stderr lines) is made safe to print."""
    from trainer.events import sanitize_for_terminal

    print(f"{prog}: {sanitize_for_terminal(message)}", file=sys.stderr)


def _report(err: DflashctlError, prog: str) -> None:
    for line in str(err).splitlines() or [type(err).__name__]:
        print_error(line, prog)
    if err.hint:
        print_error(f"hint: {err.hint}", prog)


def run_main(fn: Callable[[], int], *, prog: str = "dflashctl") -> int:
    """Run an entry point: a DflashctlError is its message (and hint) on stderr and its exit code;
    Ctrl-C is 130; a reader that left the pipe (`dflashctl status | head -1`) ends it quietly."""
    try:
        return int(fn())
    except BrokenPipeError:
        # the reader left; say nothing more
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return ExitCode.BROKEN_PIPE  # as if killed by SIGPIPE, like any filter
    except KeyboardInterrupt:
        print_error("interrupted", prog)
        return ExitCode.INTERRUPTED
    except DflashctlError as err:
        _report(err, prog)
        return int(err.exit_code)
