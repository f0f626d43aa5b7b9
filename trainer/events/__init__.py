"""The trainer's line protocol: one definition shared by the printer and every reader.

The trainer prints status, eval, phase, checkpoint and error lines to stdout (tmux) and appends
them to ``RUN/status.log``; ``dflashctl`` reads them back over SSH. Both sides import this
package, so the format and the parser can never drift apart. Torch-free on purpose (dflashctl
runs on laptops).

One module per line kind, each with its model, formatter and parser, all derived from one
template per kind (`trainer.events.grammar`): `status` (the periodic report and its extras
vocabulary), `evaluation` (``Eval: ...``), `regen` (``Regen: ...``, a regeneration job's report), `lifecycle` (phase, checkpoint and error lines);
`escapes` cleans remote text. Beside them, the run's other contracts with dflashctl:
`run_state` (RUN/run-state.json) and `checkpoint_layout` (what a checkpoint holds).

``parse_line`` never raises: anything it does not recognise becomes a ``RawLine``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from trainer.events.escapes import sanitize_for_terminal, strip_escapes
from trainer.events.evaluation import EVAL_PREFIX, EvalEvent, format_eval_line, parse_eval_line
from trainer.events.grammar import format_eta, parse_eta
from trainer.events.lifecycle import (
    CHECKPOINT_PREFIX,
    ERROR_PREFIX,
    PHASE_TEXTS,
    CheckpointEvent,
    CheckpointFailed,
    ErrorEvent,
    PhaseEvent,
    StaleState,
    checkpoint_failed_message,
    format_checkpoint_line,
    format_error_line,
    format_phase_line,
    format_state_stale,
    parse_checkpoint_line,
    parse_error_line,
    parse_phase_line,
    parse_state_stale,
)
from trainer.events.regen import REGEN_PREFIX, RegenEvent, format_regen_line, parse_regen_line
from trainer.events.status import (
    BOTTLENECK_KEY,
    BUCKET_LOSS_KEY,
    GNORM_KEY,
    LOSS_TYPE_KEY,
    STAGE_WAIT_KEYS,
    TAU_KEY,
    TOKENS_KEY,
    TRAINER_EXTRA_KEYS,
    StatusEvent,
    format_bucket_losses,
    format_status_line,
    parse_bucket_losses,
    parse_status_line,
)

__all__ = [
    "BOTTLENECK_KEY",
    "BUCKET_LOSS_KEY",
    "CHECKPOINT_PREFIX",
    "ERROR_PREFIX",
    "EVAL_PREFIX",
    "EVENT_ADAPTER",
    "GNORM_KEY",
    "LOSS_TYPE_KEY",
    "PHASE_TEXTS",
    "REGEN_PREFIX",
    "STAGE_WAIT_KEYS",
    "TAU_KEY",
    "TOKENS_KEY",
    "TRAINER_EXTRA_KEYS",
    "CheckpointEvent",
    "CheckpointFailed",
    "ErrorEvent",
    "EvalEvent",
    "Event",
    "PhaseEvent",
    "RawLine",
    "RegenEvent",
    "StaleState",
    "StatusEvent",
    "checkpoint_failed_message",
    "format_bucket_losses",
    "format_checkpoint_line",
    "format_error_line",
    "format_eta",
    "format_eval_line",
    "format_line",
    "format_phase_line",
    "format_regen_line",
    "format_state_stale",
    "format_status_line",
    "parse_bucket_losses",
    "parse_checkpoint_line",
    "parse_error_line",
    "parse_eta",
    "parse_eval_line",
    "parse_line",
    "parse_phase_line",
    "parse_regen_line",
    "parse_state_stale",
    "parse_status_line",
    "parse_text",
    "sanitize_for_terminal",
    "strip_escapes",
]


class RawLine(BaseModel):
    """Anything else (library warnings, tracebacks, truncated lines)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["raw"] = "raw"
    text: str


Event = Annotated[
    StatusEvent | EvalEvent | RegenEvent | PhaseEvent | CheckpointEvent | ErrorEvent | RawLine,
    Field(discriminator="kind"),
]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

# Every line kind's parser; each answers None at once for a line that is not of its kind.
_PARSERS = (
    parse_status_line,
    parse_eval_line,
    parse_regen_line,
    parse_checkpoint_line,
    parse_error_line,
    parse_phase_line,
)


def parse_line(line: str) -> Event:
    """Parse one line (trailing newline allowed); never raises, unknown text -> RawLine.

    Terminal escapes (CSI colours, OSC titles, ...; what a colouring pager or ``capture-pane -e``
    adds) are stripped first, so a coloured status line parses like the plain one, and every
    event's ``text`` is the stripped line: safe to print, never carrying a remote escape.
    """
    try:
        line = strip_escapes(line.rstrip("\r\n"))
        for parse in _PARSERS:
            event = parse(line)
            if event is not None:
                return event
        return RawLine(text=line)
    except Exception:  # a parser for a live feed must never take the reader down
        return RawLine(text=str(line))


def parse_text(text: str) -> list[Event]:
    """One event per non-blank line of ``text`` (a status.log tail, a ``capture-pane -J``
    capture: tmux joins wrapped rows itself). Escapes are stripped per line as in `parse_line`.
    """
    return [parse_line(ln) for ln in text.splitlines() if strip_escapes(ln).strip()]


def format_line(ev: Event) -> str:
    """Render any event back to its line."""
    if isinstance(ev, StatusEvent):
        return format_status_line(ev)
    if isinstance(ev, EvalEvent):
        return format_eval_line(ev)
    if isinstance(ev, RegenEvent):
        return format_regen_line(ev)
    return ev.text
