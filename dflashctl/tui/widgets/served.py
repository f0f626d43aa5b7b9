"""The served evaluation's line in the eval pane: the engine's tau beside the project's loop on
what the newest `dflashctl eval` evaluated (status `served`, `trainer.events.served`)."""

from __future__ import annotations

from rich.text import Text

from dflashctl.humanize import format_age
from dflashctl.runs.snapshot import ServedEval


def served_text(served: ServedEval | None) -> Text | None:
    """`served 3.410 vllm 0.32.0 · own 3.410 agree · step 400, 2h05m ago`; the verdict red
    when the engine differs from the project's loop; None before any served evaluation."""
    if served is None:
        return None
    s = served.summary
    out = Text()
    out.append("served ", style="dim")
    if s.served is None:  # an eval without an engine: the project's loop only
        out.append(f"{s.own.tau:.3f}", style="bold")
        out.append(" own loop only", style="dim")
    else:
        out.append(f"{s.served.tau:.3f}", style="bold magenta")
        out.append(f" {s.engine or 'engine'}", style="magenta")
        out.append(" · own ", style="dim")
        out.append(f"{s.own.tau:.3f}", style="bold")
        out.append(" ")
        if s.agree:
            out.append("agree", style="green")
        else:
            out.append("DIFFER", style="bold red")
    if s.partial:
        out.append(" (partial)", style="yellow")
    where = f"step {served.step}" if served.step is not None else "export"
    age = f", {format_age(served.age_s)} ago" if served.age_s is not None else ""
    out.append(f" · {where}{age}", style="dim")
    return out
