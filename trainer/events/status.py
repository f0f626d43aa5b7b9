"""The status line: the trainer's periodic report, its model, formatter and parser.

::

    [{elapsed_min}m] step={step} loss={loss:.4f|---} acc={acc:.3f|---} streak={streak:.1f|---}
    lr={lr:.2e|---} noise={noise:.4f} | tgt={tgt_bps:.2f}b/s dft={dft_bps:.2f}b/s
    ({ktok_s:.1f}Ktok/s) | q_pre=[d0, d1, ...] q_hs=[h0, ...] | epoch~{epoch:.2f} ETA={eta}
    [ | key=value ...]

(one physical line). The trainer's extras (`trainer.pipeline.status.status_line`): the stage
waits, the bottleneck, ``gnorm`` once a step has run, then after the first evaluation ``tau=``
(the last held-out simulated tau) and ``loss_b=[l0,l1,...]`` (mean loss per length bucket over
the interval, ``---`` for a bucket without a batch), ``loss_type=`` (which loss ``loss=`` is:
``LossConfig.label()``, e.g. ``ce``, ``dpace(alpha:0.5)+kd(0.3)``) and, once a step has run,
``tokens=`` (real tokens trained so far, all ranks: what `dflashctl compare` aligns runs by). The
parser reads any extras, in any order.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer.events.grammar import (
    ETA,
    INT,
    MISSING,
    QUEUE,
    LineGrammar,
    check_extra,
    number,
)

__all__ = [
    "BOTTLENECK_KEY",
    "BUCKET_LOSS_KEY",
    "GNORM_KEY",
    "LOSS_TYPE_KEY",
    "STAGE_WAIT_KEYS",
    "TAU_KEY",
    "TOKENS_KEY",
    "TRAINER_EXTRA_KEYS",
    "StatusEvent",
    "format_bucket_losses",
    "format_status_line",
    "parse_bucket_losses",
    "parse_status_line",
]

# Extra fields the trainer appends to every status line (percent of wall time in the last interval
# that a stage spent blocked), so the TUI can show which stage starves or stalls.
STAGE_WAIT_KEYS: dict[str, str] = {
    "w_pre_out": "prefetch blocked on a full q_pre",
    "w_tgt_in": "target workers waiting for a batch (q_pre empty)",
    "w_tgt_out": "target workers blocked on a full q_hs",
    "w_dft_in": "drafter waiting for hidden states (q_hs empty / out of order)",
}
BOTTLENECK_KEY = "bottleneck"  # "prefetch" | "target" | "drafter" | "---"
GNORM_KEY = "gnorm"  # the last step's gradient norm, once a step has run
TAU_KEY = "tau"  # the last evaluation's simulated tau, once one has run
BUCKET_LOSS_KEY = "loss_b"  # mean loss per length bucket over the interval: [l0,l1,...]
LOSS_TYPE_KEY = "loss_type"  # which loss the run trains ([model.loss]'s label)
TOKENS_KEY = "tokens"  # real (non-pad) tokens trained so far, all ranks (runs align by it)
# The extras every trainer status line starts with once the stages run, in print order.
TRAINER_EXTRA_KEYS = (*STAGE_WAIT_KEYS, BOTTLENECK_KEY)


class StatusEvent(BaseModel):
    """One periodic status report; ``None`` where the line shows ``---`` (or ``???`` for ETA)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["status"] = "status"
    elapsed_min: int = Field(ge=0)
    step: int = Field(ge=0)
    loss: float | None = None
    acc: float | None = None
    streak: float | None = None
    lr: float | None = None
    noise: float | None = None
    tgt_bps: float | None = None
    dft_bps: float | None = None
    ktok_s: float | None = None
    q_pre: list[int] = Field(default_factory=list)
    q_hs: list[int] = Field(default_factory=list)
    epoch: float | None = None
    eta_s: float | None = None
    extra: dict[str, str] = Field(default_factory=dict)

    @field_validator("extra")
    @classmethod
    def _extra_is_printable(cls, v: dict[str, str]) -> dict[str, str]:
        # A key or value with whitespace or '=' could not be read back from the line.
        return check_extra(v)


_STATUS = LineGrammar(
    "[{elapsed_min}m] step={step} loss={loss} acc={acc} streak={streak} lr={lr} noise={noise}"
    " | tgt={tgt_bps}b/s dft={dft_bps}b/s ({ktok_s}Ktok/s)"
    " | q_pre={q_pre} q_hs={q_hs} | epoch~{epoch} ETA={eta_s}",
    {
        "elapsed_min": INT,
        "step": INT,
        "loss": number(".4f"),
        "acc": number(".3f"),
        "streak": number(".1f"),
        "lr": number(".2e"),
        "noise": number(".4f"),
        "tgt_bps": number(".2f"),
        "dft_bps": number(".2f"),
        "ktok_s": number(".1f"),
        "q_pre": QUEUE,
        "q_hs": QUEUE,
        "epoch": number(".2f"),
        "eta_s": ETA,
    },
    extras=True,
)
STATUS_RE = _STATUS.regex  # 14 slot groups, then the extras tail


def format_status_line(ev: StatusEvent) -> str:
    """Render a StatusEvent exactly per the contract (one line, no trailing newline)."""
    return _STATUS.format(vars(ev), ev.extra)  # vars: the field values


def parse_status_line(line: str) -> StatusEvent | None:
    """The StatusEvent of a status line (no newline, no escapes), or None when it is not one."""
    values = _STATUS.parse(line)
    if values is None:
        return None
    # The grammar has checked every field's type (and float() every number), so the model is
    # built without validating again: half the cost of a line. The extras are taken as read;
    # a tests/events test compares the result with model_validate.
    return StatusEvent.model_construct(kind="status", **values)


def format_bucket_losses(losses: Iterable[float | None]) -> str:
    """The ``loss_b`` extra's value: ``[1.2345,2.0001,---]`` (no blanks: one token)."""
    return "[" + ",".join(MISSING if x is None else f"{x:.4f}" for x in losses) + "]"


def parse_bucket_losses(text: str) -> list[float | None] | None:
    """Inverse of format_bucket_losses; None when ``text`` is not such a list."""
    if len(text) < 2 or text[0] != "[" or text[-1] != "]" or any(c.isspace() for c in text):
        return None
    if text == "[]":
        return []
    try:
        values = [None if x == MISSING else float(x) for x in text[1:-1].split(",")]
    except ValueError:
        return None
    return values if all(v is None or math.isfinite(v) for v in values) else None
