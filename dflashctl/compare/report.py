"""`dflashctl compare` as text and JSON (pure): who the runs are, the aligned points per axis,
and who is ahead."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from dflashctl.compare.align import METRIC_NAMES, METRICS, Alignment, Value, label
from dflashctl.compare.sources import Picked

COLUMNS = {"tau": "tau", "eval_loss": "eval loss", "loss": "loss"}
FORMATS = {"tau": ".3f", "eval_loss": ".4f", "loss": ".4f"}


def describe(i: int, p: Picked) -> str:
    """`A = kpro6~1: run 1 of 2 in kpro6's status.log, steps 0-4000, 12,345,678 tokens, 9 evals`."""
    c = p.curves
    first = min(s[0].step for s in (c.loss, c.tau) if s)
    tokens = f", {c.last_tokens:,} tokens" if c.last_tokens is not None else ", tokens not printed"
    resumed = f", resumed {c.resumes}x" if c.resumes else ""
    return (
        f"{label(i)} = {p.spec.text}: run {p.index} of {p.count} in {p.spec.where}, steps "
        f"{first}-{c.last_step}{tokens}, {len(c.tau)} evals{resumed}"
    )


def _cell(v: Value | None, spec: str) -> str:
    if v is None:
        return "-"
    return ("~" if v.interpolated else "") + format(v.value, spec)


def table(al: Alignment, runs: int) -> list[str]:
    """The aligned points as a fixed-width table (`~`: interpolated between the run's own)."""
    head = ["step" if al.axis == "step" else "tokens"]
    for m in METRICS:
        head += [f"{COLUMNS[m]} {label(i)}" for i in range(runs)]
    body = [
        [f"{r.x:,}", *(_cell(v, FORMATS[m]) for m in METRICS for v in r.values[m])] for r in al.rows
    ]
    widths = [max(len(row[j]) for row in [head, *body]) for j in range(len(head))]
    return [
        "  ".join(cell.rjust(w) for cell, w in zip(row, widths, strict=True))
        for row in [head, *body]
    ]


def summary(al: Alignment) -> list[str]:
    """`held-out tau: B ahead at step 4,000 (3.210 vs A 3.100, +0.110); ahead at 9 of 12 points`."""
    if not al.rows:
        return []
    at = f"{'step' if al.axis == 'step' else 'tokens'} {al.rows[-1].x:,}"
    out = []
    for lead in al.leads:
        spec = FORMATS[lead.metric]
        head = f"{METRIC_NAMES[lead.metric]}: {label(lead.best)} ahead at {at} ({lead.value:{spec}}"
        if lead.runner_up is not None and lead.margin is not None:
            sign = "+" if lead.metric == "tau" else "-"
            head += f" vs {label(lead.runner_up)} "
            other = lead.value + (-lead.margin if lead.metric == "tau" else lead.margin)
            head += f"{other:{spec}}, {sign}{lead.margin:{spec}}"
        head += ")"
        wins = ", ".join(f"{label(i)} {n}" for i, n in enumerate(lead.wins))
        out.append(f"{head}; ahead at points: {wins} of {lead.compared}")
    return out


def text_report(picked: Sequence[Picked], alignments: Sequence[Alignment]) -> list[str]:
    lines = [describe(i, p) for i, p in enumerate(picked)]
    for al in alignments:
        lines.append("")
        if al.problem is not None:
            lines.append(f"by {al.axis}: {al.problem}")
            continue
        lines.append(
            f"by {al.axis}, at {label(0)}'s evaluations that every run reached "
            "(~: between the run's own points):"
        )
        lines += table(al, len(picked))
        lines += summary(al)
    return lines


def _value(v: Value | None) -> dict[str, Any] | None:
    return None if v is None else {"value": v.value, "interpolated": v.interpolated}


def json_report(picked: Sequence[Picked], alignments: Sequence[Alignment]) -> dict[str, Any]:
    runs = [
        {
            "label": label(i),
            "spec": p.spec.text,
            "source": p.spec.where,
            "run": p.index,
            "runs_in_log": p.count,
            "last_step": p.curves.last_step,
            "last_tokens": p.curves.last_tokens,
            "evals": len(p.curves.tau),
            "resumes": p.curves.resumes,
        }
        for i, p in enumerate(picked)
    ]
    out: dict[str, Any] = {"runs": runs}
    for al in alignments:
        out[f"by_{al.axis}"] = {
            "problem": al.problem,
            "points": [
                {"x": r.x, **{m: [_value(v) for v in r.values[m]] for m in METRICS}}
                for r in al.rows
            ],
            "leads": [
                {
                    "metric": lead.metric,
                    "best": label(lead.best),
                    "value": lead.value,
                    "runner_up": label(lead.runner_up) if lead.runner_up is not None else None,
                    "margin": lead.margin,
                    "wins": dict(
                        zip([label(i) for i in range(len(picked))], lead.wins, strict=True)
                    ),
                    "compared": lead.compared,
                }
                for lead in al.leads
            ],
        }
    return out
