"""Phase, checkpoint and error lines: their models, formatters and parsers.

Each keeps the line it was parsed from in ``text`` (what `format_line` prints back). A failed
checkpoint is an error line of its own grammar (``ERROR: checkpoint step=15 not written to DIR:
REASON``): every reader still sees an `ErrorEvent`, and its ``checkpoint_failed`` holds the step,
the directory and the reason.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict

from trainer.events.grammar import INT, LineGrammar, Slot

__all__ = [
    "CHECKPOINT_PREFIX",
    "ERROR_PREFIX",
    "PHASE_TEXTS",
    "CheckpointEvent",
    "CheckpointFailed",
    "ErrorEvent",
    "PhaseEvent",
    "StaleState",
    "checkpoint_failed_message",
    "format_checkpoint_line",
    "format_error_line",
    "format_phase_line",
    "format_state_stale",
    "parse_checkpoint_line",
    "parse_error_line",
    "parse_phase_line",
    "parse_state_stale",
]

_FROZEN = ConfigDict(frozen=True, extra="forbid")

# Phase lines: a fixed text per phase, optionally followed by " " + detail.
PHASE_TEXTS: dict[str, str] = {
    "loading": "Loading target and data...",
    "resuming": "Resuming from checkpoint:",
    "starting": "Starting pipeline...",
    "running": "Pipeline running. Monitoring...",
    "stopping": "Stopping pipeline...",
    "finished": "Training finished.",
    # printed by the supervisor (trainer.supervise), which runs the trainer as its child
    "restarting": "Restarting trainer:",
    "not_restarting": "Not restarting trainer:",
    "gave_up": "Supervisor gave up",
    "low_disk": "Run disk space:",  # detail "low: ..." or "ok again: ..."
    "state_stale": "Supervisor state file stale:",  # detail: `format_state_stale`
    # printed by a regeneration job (python -m trainer.regen)
    "regen_starting": "Regen starting:",  # detail: rows to do, servers
    "regen_server": "Regen server:",  # detail: one server's state change (down, up again)
    "regen_finished": "Regen finished:",  # detail: the job's summary
}
CHECKPOINT_PREFIX = "Checkpoint saved: "
ERROR_PREFIX = "ERROR: "


class PhaseEvent(BaseModel):
    """A lifecycle line such as ``Starting pipeline...``; ``detail`` is any text after it."""

    model_config = _FROZEN

    kind: Literal["phase"] = "phase"
    phase: str
    detail: str = ""
    text: str


class CheckpointEvent(BaseModel):
    """``Checkpoint saved: step=1200 path=/run/checkpoints/step-00001200.pt``."""

    model_config = _FROZEN

    kind: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str
    text: str


class CheckpointFailed(BaseModel):
    """A checkpoint the trainer could not write, and the directory it was to go to (the one to
    free space in when the reason is a full disk)."""

    model_config = _FROZEN

    step: int
    directory: str
    reason: str


class ErrorEvent(BaseModel):
    """``ERROR: <one-line message>``; the traceback, if any, follows as raw lines."""

    model_config = _FROZEN

    kind: Literal["error"] = "error"
    message: str
    text: str
    checkpoint_failed: CheckpointFailed | None = None  # the message is a failed checkpoint's


def format_phase_line(phase: str, detail: str = "") -> str:
    """The line for a lifecycle phase (one of PHASE_TEXTS)."""
    text = PHASE_TEXTS[phase]
    return f"{text} {detail}" if detail else text


def parse_phase_line(line: str) -> PhaseEvent | None:
    """The PhaseEvent of a phase line, or None when it is not one."""
    for phase, text in PHASE_TEXTS.items():
        if line == text:
            return PhaseEvent(phase=phase, text=line)
        if line.startswith(text + " "):
            return PhaseEvent(phase=phase, detail=line[len(text) + 1 :], text=line)
    return None


_CHECKPOINT = LineGrammar(
    CHECKPOINT_PREFIX + "step={step} path={path}",
    {"step": INT, "path": Slot(r"(.+)", str, str)},
    extras=False,
)


def format_checkpoint_line(step: int, path: str) -> str:
    """The line printed after a checkpoint is durably on disk."""
    return _CHECKPOINT.format({"step": step, "path": path})


def parse_checkpoint_line(line: str) -> CheckpointEvent | None:
    """The CheckpointEvent of a checkpoint line, or None when it is not one."""
    values = _CHECKPOINT.parse(line)
    return None if values is None else CheckpointEvent(**values, text=line)


def format_error_line(message: str) -> str:
    """One error line; newlines in the message are folded so the line stays one line."""
    return ERROR_PREFIX + " ".join(message.split())


# The directory ends at the first ": " (a directory whose name holds one is cut there).
_CHECKPOINT_FAILED = LineGrammar(
    "checkpoint step={step} not written to {directory}: {reason}",
    {"step": INT, "directory": Slot(r"(.+?)", str, str), "reason": Slot(r"(.+)", str, str)},
    extras=False,
)


def checkpoint_failed_message(failed: CheckpointFailed) -> str:
    """The error message of a failed checkpoint, its reason folded onto one line
    (`format_error_line` prints it)."""
    values = {**failed.model_dump(), "reason": " ".join(failed.reason.split())}
    return _CHECKPOINT_FAILED.format(values)


def parse_error_line(line: str) -> ErrorEvent | None:
    """The ErrorEvent of an ``ERROR: ...`` line, or None when it is not one."""
    if not line.startswith(ERROR_PREFIX):
        return None
    message = line[len(ERROR_PREFIX) :]
    values = _CHECKPOINT_FAILED.parse(message)
    failed = None if values is None else CheckpointFailed(**values)
    return ErrorEvent(message=message, text=line, checkpoint_failed=failed)


class StaleState(BaseModel):
    """What the supervisor is when it cannot write RUN/supervisor.json (a full disk): the file
    still says an older state, so the pane's line is the truth (and the supervisor's exit
    status, once it ends)."""

    model_config = _FROZEN

    path: str  # the state file that is out of date
    why: str  # why it could not be written
    state: str  # the supervisor's state now (supervisor.json's `state`)
    attempt: int
    exit_status: int | None = None
    detail: str = ""


def _opt_int(text: str) -> int | None:
    return None if text == "---" else int(text)


_STALE = LineGrammar(
    "{path} not written ({why}), it is out of date: the supervisor is {state}, attempt "
    "{attempt}, exit status {exit_status}{detail}",
    {
        "path": Slot(r"(.+?)", str, str),
        "why": Slot(r"(.*?)", str, str),
        "state": Slot(r"(\S+)", str, str),
        "attempt": INT,
        "exit_status": Slot(r"(\d+|---)", lambda v: "---" if v is None else str(v), _opt_int),
        # "; detail", nothing when empty (a pane capture drops trailing blanks)
        "detail": Slot(r"((?:; .*)?)", lambda d: f"; {d}" if d else "", lambda t: t[2:]),
    },
    extras=False,
)


def format_state_stale(stale: StaleState) -> str:
    """The supervisor's line for a state file it could not write (one line)."""
    values = {**stale.model_dump(), "detail": " ".join(stale.detail.split())}
    return format_phase_line("state_stale", _STALE.format(values))


def parse_state_stale(detail: str) -> StaleState | None:
    """The StaleState of a `state_stale` phase line's detail, or None."""
    values = _STALE.parse(detail)
    return None if values is None else StaleState(**values)
