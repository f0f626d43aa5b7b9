"""The regeneration status line (`python -m trainer.regen`): its model, formatter and parser.

::

    Regen: [{elapsed_min}m] rows={finished}/{total} errors={errors} length={length}
    | {rows_s:.2f}rows/s gen={gen_tok_s:.1f}tok/s prompt={prompt_tok_s:.1f}tok/s
    | in_flight=[n0, n1, ...] | ETA={eta} [ | key=value ...]

(one physical line). ``finished`` counts rows that ended this job or an earlier one it resumed
(written to OUT or to the errors file), ``total`` the rows of the input it will regenerate;
``errors`` the rows in the errors file, ``length`` the rows a reply cut at ``--max-tokens``
(kept and marked, or dropped to the errors file); the rates are this job's since it started;
``in_flight`` the requests in flight per server, in ``--server`` order. Extras the job appends:
``down`` (servers not answering), ``retries`` (failed requests retried), ``skipped`` (unreadable
input rows), ``dropped`` (length-capped rows dropped).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer.events.grammar import ETA, INT, QUEUE, LineGrammar, check_extra, number

__all__ = [
    "REGEN_PREFIX",
    "RegenEvent",
    "format_regen_line",
    "parse_regen_line",
]

REGEN_PREFIX = "Regen: "


class RegenEvent(BaseModel):
    """One periodic report of a regeneration job; None where the line shows ``---``/``???``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["regen"] = "regen"
    elapsed_min: int = Field(ge=0)
    finished: int = Field(ge=0)
    total: int = Field(ge=0)
    errors: int = Field(ge=0)
    length: int = Field(ge=0)
    rows_s: float | None = None
    gen_tok_s: float | None = None
    prompt_tok_s: float | None = None
    in_flight: list[int] = Field(default_factory=list)
    eta_s: float | None = None
    extra: dict[str, str] = Field(default_factory=dict)

    @field_validator("extra")
    @classmethod
    def _extra_is_printable(cls, v: dict[str, str]) -> dict[str, str]:
        return check_extra(v)

    def extra_int(self, key: str) -> int:
        """An integer extra (``down``, ``retries``, ...), 0 when absent or unreadable."""
        text = self.extra.get(key, "")
        return int(text) if text.isdigit() else 0


_REGEN = LineGrammar(
    REGEN_PREFIX + "[{elapsed_min}m] rows={finished}/{total} errors={errors} length={length}"
    " | {rows_s}rows/s gen={gen_tok_s}tok/s prompt={prompt_tok_s}tok/s"
    " | in_flight={in_flight} | ETA={eta_s}",
    {
        "elapsed_min": INT,
        "finished": INT,
        "total": INT,
        "errors": INT,
        "length": INT,
        "rows_s": number(".2f"),
        "gen_tok_s": number(".1f"),
        "prompt_tok_s": number(".1f"),
        "in_flight": QUEUE,
        "eta_s": ETA,
    },
    extras=True,
)


def format_regen_line(ev: RegenEvent) -> str:
    """Render a RegenEvent per its template (one line, no trailing newline)."""
    return _REGEN.format(vars(ev), ev.extra)


def parse_regen_line(line: str) -> RegenEvent | None:
    """The RegenEvent of a ``Regen: ...`` line, or None when it is not one (never raises)."""
    if not line.startswith(REGEN_PREFIX):
        return None
    values = _REGEN.parse(line)
    if values is None:
        return None
    try:
        return RegenEvent.model_validate(values)
    except ValueError:
        return None
