"""What `trainer.eval` measured: per-turn results, per-set summaries, their lines and JSON.

Pure and torch-free, so a run cut short (Ctrl-C) is summarised by the same code as a whole one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class PromptResult:
    index: int
    set: str
    line: int
    turn: int
    prompt_tokens: int
    new_tokens: int
    verify_steps: int
    tau: float
    matches_greedy: bool
    spec_seconds: float
    greedy_seconds: float
    tokens: list[int] = field(default_factory=list)
    accept_lengths: list[int] = field(default_factory=list)  # per verify step: accepted + 1


@dataclass(frozen=True)
class EvalSummary:
    name: str  # a prompt set's file name, or "all"
    protocol: str
    prompts: int  # evaluated turns (an MT-Bench question counts once per turn)
    tau: float  # mean of per-turn tau (turns with a verify step)
    tau_pooled: float  # total committed tokens / total verify steps
    new_tokens: int
    verify_steps: int
    matches: int
    block_size: int
    spec_seconds: float
    greedy_seconds: float


def summarize(
    results: Sequence[PromptResult], name: str, protocol: str, block_size: int
) -> EvalSummary:
    steps = sum(r.verify_steps for r in results)
    committed = sum(r.tau * r.verify_steps for r in results)
    # A turn whose first token is already EOS has no verify step, hence no tau ("exact").
    measured = [r.tau for r in results if r.verify_steps]
    return EvalSummary(
        name=name,
        protocol=protocol,
        prompts=len(results),
        tau=sum(measured) / len(measured) if measured else 0.0,
        tau_pooled=committed / steps if steps else 0.0,
        new_tokens=sum(r.new_tokens for r in results),
        verify_steps=steps,
        matches=sum(r.matches_greedy for r in results),
        block_size=block_size,
        spec_seconds=sum(r.spec_seconds for r in results),
        greedy_seconds=sum(r.greedy_seconds for r in results),
    )


def summarize_sets(
    results: Sequence[PromptResult],
    sets: Sequence[tuple[str, int]],
    protocol: str,
    block_size: int,
) -> list[EvalSummary]:
    """One summary per prompt set, given as (name, turns) in run order (results come set by
    set, one per turn; fewer when the run was cut short), then the overall one ("all")."""
    out, start = [], 0
    for name, turns in sets:
        out.append(summarize(results[start : start + turns], name, protocol, block_size))
        start += turns
    return [*out, summarize(results, "all", protocol, block_size)]


def format_result(r: PromptResult) -> str:
    return (
        f"prompt {r.set}:{r.line} turn {r.turn}: tau={r.tau:.2f} steps={r.verify_steps} "
        f"new_tokens={r.new_tokens} greedy_match={'yes' if r.matches_greedy else 'NO'}"
    )


def format_summary(s: EvalSummary) -> str:
    label = "all sets" if s.name == "all" else f"set {s.name}"
    return (
        f"{label}: tau={s.tau:.3f} (protocol {s.protocol}, pooled {s.tau_pooled:.3f}, "
        f"block {s.block_size}) prompts={s.prompts} new_tokens={s.new_tokens} "
        f"verify_steps={s.verify_steps} greedy_match={s.matches}/{s.prompts} "
        f"spec={s.spec_seconds:.1f}s greedy={s.greedy_seconds:.1f}s"
    )


def results_json(
    protocol: str,
    stop_ids: Sequence[int],
    results: Sequence[PromptResult],
    summaries: Sequence[EvalSummary],
) -> dict[str, Any]:
    """The `--json` document: the overall summary, one per set, and every turn."""
    return {
        "protocol": protocol,
        "stop_ids": list(stop_ids),
        "summary": asdict(summaries[-1]),
        "sets": [asdict(s) for s in summaries[:-1]],
        "prompts": [asdict(r) for r in results],
    }
