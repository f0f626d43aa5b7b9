"""Status-line parser throughput: parse_line (plain, raw, ANSI-coloured), parse_text on a
status.log block, format.

Run: .venv/bin/python benchmarks/bench_parser.py   (the product reads about one status line per
5 s per host, and a status read parses a 400-line tail: any rate above ~10k lines/s is plenty)
"""

from __future__ import annotations

import gc
import os
import random
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from trainer.events import (
    STAGE_WAIT_KEYS,
    StatusEvent,
    format_status_line,
    parse_eta,
    parse_line,
    parse_text,
)
from trainer.events.status import STATUS_RE
from trainer.pipeline.status import Board, status_line


def _lines(n: int) -> list[str]:
    """n status lines built by the trainer's own status_line, with varying values everywhere.

    Every field changes from line to line as in a real run (the stage-wait percentages, the
    bottleneck and the gradient norm included), so memoised fields hit only as often as they
    would on a real status.log.
    """
    rng = random.Random(0)
    out: list[str] = []
    for i in range(n):
        board = Board(step=i, lr=rng.uniform(0, 6e-4), gnorm=rng.uniform(0.1, 8))
        waits = {k: rng.uniform(0, 100) for k in STAGE_WAIT_KEYS}
        line = status_line(
            elapsed_s=i * 6.0,
            board=board,
            metrics={
                "loss": rng.uniform(0.5, 8),
                "acc": rng.random(),
                "streak": rng.uniform(0, 15),
            },
            noise=0.1,
            tgt_bps=rng.uniform(0, 5),
            dft_bps=rng.uniform(0, 5),
            ktok_s=rng.uniform(0, 40),
            q_pre=[rng.randint(0, 16) for _ in range(6)],
            q_hs=[rng.randint(0, 8)],
            epoch=i / n * 6,
            eta_s=rng.uniform(0, 1e6),
            waits=waits,
        )
        out.append(line)
    return out


def _validated(line: str) -> StatusEvent:
    """For scale: the line's regex, then pydantic validates the fields (parse_line skips that)."""
    m = STATUS_RE.fullmatch(line)
    assert m is not None, line
    g = m.groups()
    num = [None if x == "---" else float(x) for x in g[2:10]]
    return StatusEvent.model_validate(
        dict(
            zip(
                ("loss", "acc", "streak", "lr", "noise", "tgt_bps", "dft_bps", "ktok_s"),
                num,
                strict=True,
            ),
            elapsed_min=g[0],
            step=g[1],
            q_pre=[int(x) for x in g[10][1:-1].split(", ") if x],
            q_hs=[int(x) for x in g[11][1:-1].split(", ") if x],
            epoch=None if g[12] == "---" else float(g[12]),
            eta_s=parse_eta(g[13]),
            extra=dict(pair.split("=", 1) for pair in g[14].removeprefix(" | ").split(" ")),
        )
    )


T = TypeVar("T")


def _consume(fn: Callable[[T], object], items: Sequence[T]) -> None:
    for x in items:  # results dropped: measures the parser, not the collector on a 100k list
        fn(x)


def main() -> None:
    n, rounds = 100_000, 7
    lines = _lines(n)
    assert all(_validated(ln) == parse_line(ln) for ln in lines[:1000])
    raw = [f"some library warning number {i}" for i in range(n)]
    coloured = [f"\x1b[32m{ln}\x1b[0m" for ln in lines[:20_000]]  # capture-pane -e, a pager
    block = "\n".join(lines[:20_000])  # a status.log read in one go
    statuses = [ev for ln in lines[:20_000] if isinstance(ev := parse_line(ln), StatusEvent)]
    cases: dict[str, tuple[Callable[[], object], int]] = {  # name -> (work, lines it handles)
        "parse_line status lines": (lambda: _consume(parse_line, lines), n),
        "regex + model_validate": (lambda: _consume(_validated, lines[:20_000]), 20_000),
        "parse_line raw lines": (lambda: _consume(parse_line, raw), n),
        "parse_line coloured": (lambda: _consume(parse_line, coloured), 20_000),
        "parse_text status.log": (lambda: parse_text(block), 20_000),
        "format_status_line": (lambda: _consume(format_status_line, statuses), 20_000),
    }
    gc.freeze()
    print(f"load average: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores; {rounds} rounds")
    # Interleaved rounds: this VM's speed drifts by tens of percent within a minute, so every
    # case is timed in every round and the ratio is taken round by round.
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, (work, count) in cases.items():
            t0 = time.process_time()
            work()
            rates[name].append(count / max(time.process_time() - t0, 1e-9))
    # Best round first: like timeit's minimum, it is the machine's speed with the least
    # interference; the median shows how much this VM's throttling takes away.
    print(f"{'lines/s (CPU time)':<24}  {'best':>10}  {'median':>10}  {'worst':>10}")
    for name, r in rates.items():
        r_sorted = sorted(r)
        best, med, worst = r_sorted[-1], r_sorted[len(r) // 2], r_sorted[0]
        print(f"{name:<24}  {best:>10,.0f}  {med:>10,.0f}  {worst:>10,.0f}")
    ratios = sorted(
        a / b
        for a, b in zip(
            rates["parse_line status lines"], rates["regex + model_validate"], strict=True
        )
    )
    print(
        f"parse_line / regex + model_validate, same round: median {ratios[len(ratios) // 2]:.2f}x"
    )


if __name__ == "__main__":
    main()
