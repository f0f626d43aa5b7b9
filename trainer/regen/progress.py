"""A job's counters and its status line (`trainer.events.RegenEvent`). Pure."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.events import RegenEvent, format_regen_line
from trainer.regen.requests import Counts


@dataclass
class Tally:
    """Rows of this job's scope: how many there are, how many ended before it (a resume) and
    in it. `errors`: rows in the errors file (failed); `length`: rows a reply cut at
    --max-tokens (kept and marked, or `dropped` to the errors file)."""

    total: int = 0
    before: int = 0  # rows of the scope already in OUT or the errors file
    errors_before: int = 0
    length_before: int = 0
    written: int = 0
    errors: int = 0
    length: int = 0
    dropped: int = 0
    skipped: int = 0  # unreadable input rows (the importer's accounting)
    reasons: dict[str, int] = field(default_factory=dict)  # this job's errors by reason

    @property
    def ended_now(self) -> int:
        return self.written + self.errors + self.dropped

    @property
    def finished(self) -> int:
        return self.before + self.ended_now

    def error(self, reason: str) -> None:
        self.errors += 1
        self.reasons[reason] = self.reasons.get(reason, 0) + 1


def regen_event(
    tally: Tally, counts: Counts, in_flight: list[int], down: int, elapsed_s: float
) -> RegenEvent:
    """The status report now; rates are this job's since it started (None before any row)."""
    seconds = max(elapsed_s, 1e-9)
    rows_s = tally.ended_now / seconds if tally.ended_now else None
    left = max(0, tally.total - tally.finished)
    eta = 0.0 if not left else (left / rows_s if rows_s else None)
    extra = {"down": str(down), "retries": str(counts.retries), "skipped": str(tally.skipped)}
    if tally.dropped:
        extra["dropped"] = str(tally.dropped)
    return RegenEvent(
        elapsed_min=int(elapsed_s // 60),
        finished=tally.finished,
        total=tally.total,
        errors=tally.errors_before + tally.errors,
        length=tally.length_before + tally.length,
        rows_s=rows_s,
        gen_tok_s=counts.completion_tokens / seconds if counts.requests else None,
        prompt_tok_s=counts.prompt_tokens / seconds if counts.requests else None,
        in_flight=in_flight,
        eta_s=eta,
        extra=extra,
    )


def status_line(
    tally: Tally, counts: Counts, in_flight: list[int], down: int, elapsed_s: float
) -> str:
    return format_regen_line(regen_event(tally, counts, in_flight, down, elapsed_s))


def summary(tally: Tally, counts: Counts, elapsed_s: float, on_length: str) -> str:
    """The finish line's detail: what this job did, and its rates."""
    seconds = max(elapsed_s, 1e-9)
    reasons = ", ".join(f"{k} {v}" for k, v in sorted(tally.reasons.items()))
    parts = [
        f"{tally.finished} of {tally.total} rows ended ({tally.before} before this job)",
        f"{tally.written} written",
        f"{tally.length} length-capped ({'dropped' if on_length == 'drop' else 'kept, marked'})",
        f"{tally.errors} errors" + (f" ({reasons})" if reasons else ""),
        f"{tally.skipped} input rows skipped",
        f"{counts.requests} requests, {counts.retries} retried",
        f"{counts.completion_tokens} generated tokens in {elapsed_s:.1f} s "
        f"({counts.completion_tokens / seconds:.1f} gen tok/s, "
        f"{counts.prompt_tokens / seconds:.1f} prompt tok/s)",
    ]
    return "; ".join(parts)
