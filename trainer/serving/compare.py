"""The engine's acceptance beside the project's loop on the same turns, and the verdict. Pure.

Both loops verify greedily, so on identical tokens they differ only where a draft token's
argmax flips between two implementations of the same drafter (kernels, summation order): each
such verify step moves each per-position count by at most one. The tolerance is the share of
verify steps allowed to do that (`tolerance`, default 1 %, rounded down: a run of fewer than
100 steps must agree exactly); measured: 0 such steps in every run so far (1,407 steps on a
weak drafter; the gate's drafter on its sample and on chat prompts; docs/benchmarks.md).
Anything beyond is a drafter the engine does not read as it was trained.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from trainer.eval_results import PromptResult
from trainer.serving.metrics import SpecCounters

DEFAULT_TOLERANCE = 0.01


@dataclass(frozen=True)
class ServedTurn:
    """What the engine did on one turn (the project's loop did `PromptResult` `index`)."""

    index: int
    tokens: list[int]
    counters: SpecCounters
    tokens_match: bool  # the engine committed exactly the project's loop's tokens
    first_difference: int | None = None  # index of the first differing token


def own_counters(accept_lengths: Sequence[int], block_size: int) -> SpecCounters:
    """The project's loop's verify steps as the engine counts them."""
    k = block_size - 1
    per_pos = [0] * k
    for length in accept_lengths:
        for pos in range(min(length - 1, k)):
            per_pos[pos] += 1
    return SpecCounters(
        drafts=len(accept_lengths),
        draft_tokens=k * len(accept_lengths),
        accepted=sum(length - 1 for length in accept_lengths),
        per_position=tuple(per_pos),
    )


def served_turn(
    index: int, own: Sequence[int], served: list[int], counters: SpecCounters
) -> ServedTurn:
    first = next((i for i, (a, b) in enumerate(zip(own, served, strict=False)) if a != b), None)
    if first is None and len(own) != len(served):
        first = min(len(own), len(served))
    return ServedTurn(index, served, counters, first is None, first)


@dataclass(frozen=True)
class Side:
    """One loop's figures over some turns, counted as under the "exact" protocol."""

    tau: float  # mean of per-turn taus (turns with a verify step), as trainer.eval
    counters: SpecCounters  # pooled: tau_pooled = counters.tau

    @classmethod
    def of(cls, per_turn: Sequence[SpecCounters]) -> Side:
        total = sum(per_turn, SpecCounters())
        measured = [c.tau for c in per_turn if c.drafts]
        return cls(sum(measured) / len(measured) if measured else 0.0, total)


@dataclass(frozen=True)
class Comparison:
    """Own vs served over the turns both ran, and whether they agree within the tolerance."""

    name: str  # a prompt set, or "all"
    turns: int
    tokens_match: int  # turns where both committed identical tokens
    own: Side
    served: Side
    tolerance: float
    allowed_steps: int  # verify steps allowed to differ at each position
    differences: list[str] = field(default_factory=list)

    @property
    def agree(self) -> bool:
        return not self.differences

    @property
    def ratio(self) -> float:
        return self.served.tau / self.own.tau if self.own.tau else 0.0


def compare(
    name: str,
    own: Sequence[SpecCounters],
    served: Sequence[ServedTurn],
    *,
    tolerance: float = DEFAULT_TOLERANCE,
) -> Comparison:
    """Turns are paired in order (`own[i]` with `served[i]`); extra own turns (a run cut short
    mid-turn) are left out."""
    own = list(own)[: len(served)]
    mine, theirs = Side.of(own), Side.of([t.counters for t in served])
    allowed = math.floor(tolerance * mine.counters.drafts)
    diffs: list[str] = []
    a, b = mine.counters, theirs.counters
    if abs(a.drafts - b.drafts) > allowed:
        diffs.append(f"verify steps {b.drafts} served vs {a.drafts} own")
    width = max(len(a.per_position), len(b.per_position))
    for k in range(width):
        x = a.per_position[k] if k < len(a.per_position) else 0
        y = b.per_position[k] if k < len(b.per_position) else 0
        if abs(x - y) > allowed:
            diffs.append(f"position {k + 1} accepted {y} served vs {x} own")
    matched = sum(t.tokens_match for t in served)
    if matched != len(served):
        diffs.append(f"tokens differ in {len(served) - matched} of {len(served)} turns")
    return Comparison(name, len(served), matched, mine, theirs, tolerance, allowed, diffs)


def _rates(c: SpecCounters) -> str:
    return "[" + " ".join(f"{r:.2f}" for r in c.rates()) + "]"


def format_comparison(c: Comparison, engine: str) -> list[str]:
    label = "all sets" if c.name == "all" else f"set {c.name}"
    width = max(len(engine), len("own loop"))
    lines = [
        f"{label}: {side:<{width}} tau={s.tau:.3f} (protocol exact, pooled {s.counters.tau:.3f}) "
        f"verify_steps={s.counters.drafts} accepted={s.counters.accepted} "
        f"per-position acceptance {_rates(s.counters)}"
        for side, s in ((engine, c.served), ("own loop", c.own))
    ]
    verdict = "agree" if c.agree else "DIFFER"
    lines.append(
        f"{label}: served/own tau {c.ratio:.3f}; tokens identical in {c.tokens_match}/{c.turns} "
        f"turns; {verdict} (tolerance {c.allowed_steps} verify step(s) per position)"
    )
    return lines


def comparison_json(c: Comparison) -> dict[str, Any]:
    def side(s: Side) -> dict[str, Any]:
        return {
            "tau": s.tau,
            "tau_pooled": s.counters.tau,
            "verify_steps": s.counters.drafts,
            "draft_tokens": s.counters.draft_tokens,
            "accepted": s.counters.accepted,
            "accepted_per_position": list(s.counters.per_position),
            "acceptance_per_position": s.counters.rates(),
        }

    return {
        "name": c.name,
        "protocol": "exact",
        "turns": c.turns,
        "tokens_match": c.tokens_match,
        "served": side(c.served),
        "own": side(c.own),
        "served_over_own_tau": c.ratio,
        "tolerance": c.tolerance,
        "allowed_steps": c.allowed_steps,
        "agree": c.agree,
        "differences": list(c.differences),
    }


def served_turn_json(t: ServedTurn) -> dict[str, Any]:
    out = asdict(t)
    out["counters"] = asdict(t.counters)
    return out


def own_of(results: Sequence[PromptResult], block_size: int) -> list[SpecCounters]:
    return [own_counters(r.accept_lengths, block_size) for r in results]
