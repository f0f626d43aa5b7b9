"""The one error base of the trainer, and its exit codes.

Every error a user can cause (a bad config key, a malformed store, a checkpoint that does not
fit) is a `TrainerError`: one line naming the file, key or line; `hint` (optional) says what
to do. Subclasses may also derive from the builtin they used to be (`ValueError`, ...), so
callers that caught those keep working. Torch-free.
"""

from __future__ import annotations

from enum import IntEnum


class ExitCode(IntEnum):
    """What `python -m trainer` and `python -m trainer.supervise` exit with."""

    OK = 0
    FAILED = 1  # training failed (a stage crashed, a stop lost steps)
    USAGE = 2  # the run was refused: bad config, data or checkpoint (restarting cannot help)
    UNSAVED = 3  # checkpoints kept failing: stopped rather than train steps that cannot be kept
    INTERRUPTED = 130  # Ctrl-C / SIGTERM cut a tool short (trainer.data, trainer.eval)


class TrainerError(Exception):
    """Base of every error the trainer reports to the user (one line, plus an optional hint)."""

    exit_code: ExitCode = ExitCode.USAGE

    def __init__(self, *args: object, hint: str | None = None) -> None:
        super().__init__(*args)
        self.hint = hint

    def one_line(self) -> str:
        """The message, then the hint when there is one."""
        text = str(self)
        return f"{text} (hint: {self.hint})" if self.hint else text
