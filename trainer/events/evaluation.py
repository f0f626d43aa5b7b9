"""The eval line: one per in-training evaluation, its model, formatter and parser.

::

    Eval: step={step} tau={tau:.3f|---} [tau_real={:.3f}] loss={loss:.4f|---} acc={acc:.3f|---}
    acc@1={:.3f} ... acc@{B-1}={:.3f} tau_exp={tau_exp:.3f|---} best={step|---} [ | key=value ...]

``acc@k`` for k = 1..B-1, ``tau_real`` only when prompts are configured, ``best`` = step of the
best checkpoint so far.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from trainer.events.grammar import INT, MISSING, LineGrammar, Slot, check_extra, number

__all__ = ["EVAL_PREFIX", "EvalEvent", "format_eval_line", "parse_eval_line"]

EVAL_PREFIX = "Eval: "


class EvalEvent(BaseModel):
    """One held-out evaluation: ``Eval: step=400 tau=3.214 loss=1.2345 ... best=400``.

    ``acc_at[k-1]`` is acc@k, the share of blocks whose first k drafted tokens all match;
    ``tau`` is the serving walk's simulated tau, ``tau_exp`` the tau expected from acc@k and
    ``tau_real`` real greedy speculative tau on the configured prompts; ``best`` the step of the
    best checkpoint so far.  ``extra`` holds any ``key=value`` after ``" | "`` (rows, cost).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    kind: Literal["eval"] = "eval"
    step: int = Field(ge=0)
    tau: float | None = None
    tau_real: float | None = None
    loss: float | None = None
    acc: float | None = None
    acc_at: list[float] = Field(default_factory=list)
    tau_exp: float | None = None
    best: int | None = Field(default=None, ge=0)
    extra: dict[str, str] = Field(default_factory=dict)

    @field_validator("extra")
    @classmethod
    def _extra_is_printable(cls, v: dict[str, str]) -> dict[str, str]:
        return check_extra(v)


def _format_tau_real(value: float | None) -> str:
    return "" if value is None else f" tau_real={value:.3f}"


def _parse_tau_real(text: str) -> float | None:
    return float(text.removeprefix(" tau_real=")) if text else None


_ACC_AT_RE = re.compile(r" acc@(\d+)=([^ ]+)")


def _format_acc_at(values: list[float]) -> str:
    return "".join(f" acc@{k}={a:.3f}" for k, a in enumerate(values, 1))


def _parse_acc_at(text: str) -> list[float]:
    pairs = _ACC_AT_RE.findall(text)
    if [k for k, _ in pairs] != [str(k) for k in range(1, len(pairs) + 1)]:
        raise ValueError(f"acc@k not numbered 1, 2, ...: {text!r}")
    return [float(a) for _, a in pairs]


def _parse_best(text: str) -> int | None:
    return None if text == MISSING else int(text)


_EVAL = LineGrammar(
    EVAL_PREFIX + "step={step} tau={tau}{tau_real} loss={loss} acc={acc}{acc_at}"
    " tau_exp={tau_exp} best={best}",
    {
        "step": INT,
        "tau": number(".3f"),
        "tau_real": Slot(r"((?: tau_real=[^ ]+)?)", _format_tau_real, _parse_tau_real),
        "loss": number(".4f"),
        "acc": number(".3f"),
        "acc_at": Slot(r"((?: acc@\d+=[^ ]+)*)", _format_acc_at, _parse_acc_at),
        "tau_exp": number(".3f"),
        "best": Slot(rf"(\d+|{MISSING})", lambda v: MISSING if v is None else str(v), _parse_best),
    },
    extras=True,
)


def format_eval_line(ev: EvalEvent) -> str:
    """Render an EvalEvent per the contract (one line, no trailing newline)."""
    return _EVAL.format(vars(ev), ev.extra)  # vars: the field values


def parse_eval_line(line: str) -> EvalEvent | None:
    """The EvalEvent of an ``Eval: ...`` line, or None when it is not one (never raises)."""
    values = _EVAL.parse(line)
    if values is None:
        return None
    try:
        return EvalEvent.model_validate(values)  # one line per evaluation: validate it
    except ValueError:  # pydantic's ValidationError is a ValueError
        return None
