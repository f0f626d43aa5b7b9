"""The served evaluation's summary: what `python -m trainer.eval --summary-json OUT` writes and
dflashctl reads (its status round trip, the TUI's eval pane). A contract like `run_state`:
torch-free, one writer (`served_summary`, from trainer.eval's own --json document) and one
parser (`parse_served_summary`), small enough to read on every status poll.

::

    {"version": 1, "protocol": "exact", "partial": false, "turns": 12, "block_size": 4,
     "matches_greedy": 12,
     "own": {"tau": 3.41, "tau_pooled": 3.38, "verify_steps": 530,
             "acceptance_per_position": [0.93, 0.81, 0.64]},
     "engine": "vllm 0.32.0",
     "served": {"tau": 3.41, ...}, "agree": true, "differences": []}

`own.acceptance_per_position` and everything served are there only when an engine ran.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

__all__ = [
    "ENGINES",
    "ENGINE_METAVAR",
    "SUMMARY_VERSION",
    "ServedSide",
    "ServedSummary",
    "engine_arg",
    "engine_name",
    "parse_served_summary",
    "served_summary",
]

SUMMARY_VERSION = 1

# The engines `--engine` takes (trainer.eval, trainer.gate, dflashctl eval/gate), and why the
# others are refused (docs/serving.md, "SGLang").
ENGINES = ("vllm",)
ENGINE_METAVAR = "{" + ",".join(ENGINES) + "}"  # what --help shows, as argparse's choices do
NOT_SUPPORTED = {
    "sglang": "SGLang is not supported: its DFlash worker needs CUDA and its CPU kernels are on "
    "no package index, so its counters were never checked against a running SGLang; serve the "
    "export with vLLM (docs/serving.md)",
}


def engine_name(value: str) -> str:
    """`--engine`'s value as a supported engine name; ValueError saying why it is not one."""
    name = value.strip().lower()
    if name in ENGINES:
        return name
    if name in NOT_SUPPORTED:
        raise ValueError(f"{value}: {NOT_SUPPORTED[name]}")
    raise ValueError(f"{value!r}: one of {', '.join(ENGINES)}")


def engine_arg(value: str) -> str:
    """argparse's `type=` for `--engine`: its error line says why a name is refused."""
    try:
        return engine_name(value)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


class ServedSide(BaseModel):
    """One loop's figures over the evaluated turns."""

    model_config = ConfigDict(frozen=True, extra="allow")

    tau: float
    tau_pooled: float | None = None
    verify_steps: int | None = Field(default=None, ge=0)
    acceptance_per_position: list[float] = Field(default_factory=list)


class ServedSummary(BaseModel):
    """A served evaluation at a glance: the project's loop and the engine on the same turns."""

    model_config = ConfigDict(frozen=True, extra="allow")

    version: int = SUMMARY_VERSION
    protocol: str
    partial: bool = False
    turns: int = Field(ge=0)
    block_size: int = Field(ge=0)
    matches_greedy: int | None = Field(default=None, ge=0)
    own: ServedSide
    engine: str | None = None
    served: ServedSide | None = None
    agree: bool | None = None
    differences: list[str] = Field(default_factory=list)

    @property
    def ratio(self) -> float | None:
        """served tau / own tau (None without an engine or an own tau)."""
        if self.served is None or not self.own.tau:
            return None
        return self.served.tau / self.own.tau


def _side(d: Mapping[str, Any]) -> ServedSide:
    return ServedSide(
        tau=float(d["tau"]),
        tau_pooled=d.get("tau_pooled"),
        verify_steps=d.get("verify_steps"),
        acceptance_per_position=list(d.get("acceptance_per_position") or []),
    )


def served_summary(payload: Mapping[str, Any], *, partial: bool) -> ServedSummary:
    """The summary of trainer.eval's --json document (`results_json` + the served sections)."""
    summary = payload["summary"]
    served = (payload.get("served") or {}).get("summary")
    engine = payload.get("engine")
    own = _side(summary)
    if served is not None:  # the per-position rates of the own loop come with the comparison
        own = own.model_copy(
            update={"acceptance_per_position": list(served["own"]["acceptance_per_position"])}
        )
    return ServedSummary(
        protocol=str(summary["protocol"]),
        partial=partial,
        turns=int(summary["prompts"]),
        block_size=int(summary["block_size"]),
        matches_greedy=summary.get("matches"),
        own=own,
        engine=f"{engine['name']} {engine['version']}" if engine else None,
        served=_side(served["served"]) if served is not None else None,
        agree=bool(served["agree"]) if served is not None else None,
        differences=[str(d) for d in served["differences"]] if served is not None else [],
    )


def parse_served_summary(text: str) -> tuple[ServedSummary | None, str | None]:
    """(summary, None), or (None, why) for text that is not one; (None, None) when empty."""
    if not text.strip():
        return None, None
    try:
        return ServedSummary.model_validate_json(text), None
    except ValidationError as err:
        first = err.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(document)"
        return None, f"{where}: {first['msg']}"
