"""TUI frame time and CPU: 16 hosts at 2 status lines per second each, replayed (no SSH).

Runs the real app headless (Textual's compositor still lays out and renders every frame; only
the terminal write is skipped) and feeds it seed-shaped status lines on a wall-clock schedule.
Side by side in one run:

* fleet screen vs. host screen, both with the coalesced 4 Hz redraw the app uses;
* the host screen with a naive redraw after every line (what coalescing avoids).

Each status line carries the trainer's `loss_b=[...]` extra and every host prints an `Eval:`
line every `EVAL_EVERY` status lines, so the host screen's eval pane, per-bucket pane and loss
chart (textual-plotext, replotted only when its data changed) are in the measured redraws.

Reported: the app's flush (our widget updates) p50/p95/max in ms, frames drawn, and process CPU
as a percent of one core over the run (includes Textual's layout and rendering).

    .venv/bin/python benchmarks/bench_tui.py [--seconds 15]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.tui.fixtures

from dflashctl.monitor.plan import RunShape
from dflashctl.tui.app import DflashApp, HostBinding
from tests.tui.fixtures import bucket_losses, eval_event, service
from trainer.events import (
    BUCKET_LOSS_KEY,
    StatusEvent,
    format_bucket_losses,
    format_eval_line,
    format_status_line,
)

HOSTS = 16
LINES_PER_S = 2.0
BOUNDARIES = (0, 770, 1216, 1728, 2432, 3296, 8192)
EVAL_EVERY = 20


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    if step < warmup:
        return 6e-4 * (step + 1) / warmup
    p = min(1.0, (step - warmup) / max(1, total - warmup))
    return 6e-4 * (0.1 + 0.45 * (1 + math.cos(math.pi * p)))


def lines(host: int, i: int) -> list[str]:
    """The i-th status line of `host`, and an eval line after every EVAL_EVERY-th."""
    out = [status(host, i)]
    if i and i % EVAL_EVERY == 0:
        out.append(format_eval_line(eval_event(i // EVAL_EVERY - 1)))
    return out


def status(host: int, i: int) -> str:
    ramp = min(1.0, i / 20)
    return format_status_line(
        StatusEvent(
            elapsed_min=i // 30,
            step=3 * i,
            loss=6.0 - 2 * ramp + 0.2 * math.sin(i + host),
            acc=0.1 + 0.2 * ramp,
            streak=0.2 + ramp,
            lr=warmup_cosine(3 * i, 3598, 89950),
            noise=0.1,
            tgt_bps=0.8 * ramp,
            dft_bps=0.6 * ramp,
            ktok_s=25.0 * ramp + math.sin(i / 3),
            q_pre=[(i * 7 + b * 5 + host) % 51 for b in range(6)],
            q_hs=[(i + host) % 4],
            epoch=3 * i / 15000,
            eta_s=5.1 * 86400,
            extra={
                "w_tgt_in": str((i * 3) % 60),
                "bottleneck": "target",
                BUCKET_LOSS_KEY: format_bucket_losses(bucket_losses(i)),
            },
        )
    )


@dataclass
class Result:
    name: str
    flush_ms: list[float]
    frames: int
    lines: int
    cpu_pct: float
    replots: int | None = None
    """Loss-chart replots on the host screen (None on the fleet screen)."""


async def scenario(
    name: str, seconds: float, *, host_screen: bool, naive: bool, rate: float = LINES_PER_S
) -> Result:
    shape = RunShape(
        boundaries=BOUNDARIES,
        q_pre_capacity=50,
        q_hs_capacity=4,
        warmup_steps=3598,
        total_steps=89950,
        epochs=6.0,
        schedule=warmup_cosine,
    )
    names = [f"kpro{i:02d}" for i in range(HOSTS)]
    # live=False: the app never calls the run service; an idle test double stands in.
    app = DflashApp([HostBinding(n, service(), shape=shape) for n in names], live=False)
    flush_ms: list[float] = []
    original = app.flush

    def timed_flush() -> None:
        t0 = time.perf_counter()
        original()
        flush_ms.append((time.perf_counter() - t0) * 1000)

    app.flush = timed_flush  # type: ignore[method-assign]
    fed = 0
    async with app.run_test(size=(160, 50)) as pilot:
        await pilot.pause()
        if host_screen:
            app.open_host(names[0])
            await pilot.pause(0.2)
        flush_ms.clear()
        frames0 = app.frames
        cpu0, wall0 = time.process_time(), time.perf_counter()
        interval = 1.0 / (HOSTS * rate) if rate else seconds
        i = 0
        while time.perf_counter() - wall0 < seconds:
            if not rate:
                await asyncio.sleep(seconds)
                break
            host = i % HOSTS
            app.feed(names[host], lines(host, i // HOSTS))
            fed += 1
            if naive:
                app.flush()
            i += 1
            target = wall0 + i * interval
            await asyncio.sleep(max(0.0, target - time.perf_counter()))
        cpu = time.process_time() - cpu0
        wall = time.perf_counter() - wall0
        frames = app.frames - frames0
        replots = None
        if host_screen:
            from dflashctl.tui.widgets.loss_plot import LossPlot

            replots = app.screen.query_one("#loss-plot", LossPlot).replots
    return Result(name, flush_ms, frames, fed, 100.0 * cpu / wall, replots)


def pct(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else float("nan")


async def main(seconds: float) -> None:
    results = [
        await scenario("fleet, idle (baseline)", seconds, host_screen=False, naive=False, rate=0),
        await scenario("fleet, coalesced 4 Hz", seconds, host_screen=False, naive=False),
        await scenario("host, coalesced 4 Hz", seconds, host_screen=True, naive=False),
        await scenario("host, redraw per line", seconds, host_screen=True, naive=True),
    ]
    print(f"{HOSTS} hosts x {LINES_PER_S:g} lines/s, {seconds:g} s each, terminal 160x50, headless")
    print(
        f"{'scenario':<24}{'lines':>7}{'frames':>8}{'flush p50':>11}{'p95':>8}{'max':>8}"
        f"{'CPU %':>8}{'replots':>9}"
    )
    for r in results:
        print(
            f"{r.name:<24}{r.lines:>7}{r.frames:>8}"
            f"{statistics.median(r.flush_ms):>9.2f}ms{pct(r.flush_ms, 0.95):>6.2f}ms"
            f"{max(r.flush_ms):>6.2f}ms{r.cpu_pct:>8.1f}"
            f"{'' if r.replots is None else r.replots:>9}"
        )
    base = results[2].cpu_pct
    print(f"coalescing saves {results[3].cpu_pct - base:.1f} points of CPU on the host screen")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=15.0)
    asyncio.run(main(ap.parse_args().seconds))
