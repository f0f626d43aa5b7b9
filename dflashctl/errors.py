"""The one error base of dflashctl, and the exit codes every command ends with.

Every error a user can cause (a bad inventory key, an unreachable host, a refused resume) is a
`DflashctlError`: its message is one line naming the file, key, line or host; `hint` (optional)
says what to do about it; `exit_code` is what the CLI exits with. `cli.main` and `demo.main`
catch this one class (see `dflashctl.cli.run_main`), never a list of unrelated ones.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What `dflashctl` exits with (documented in docs/dflashctl.md)."""

    OK = 0
    FAILED = 1  # the command ran and the thing it drives failed (deploy, start, a remote step)
    USAGE = 2  # the user's input is wrong (arguments, inventory, config, a refused choice)
    UNREACHABLE = 3  # a host could not be reached (connect, auth, host key)


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
