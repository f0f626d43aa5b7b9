"""One overall time budget per test: waits end on their condition or when the test's budget
does, never at a per-step deadline (docs/design.md), so a loaded machine that is slow at one step
is not failed for it.

The budget is the test's pytest-timeout (the `timeout` marker, else pyproject's `timeout`)
scaled by `contention()`, how much slower this machine runs work now than an idle one; the
hook in tests/conftest.py starts the timer with the scaled value, so the suite's hang guard
stretches with the load instead of failing a test the load merely slowed. Waits here end
`margin()` before that timer fires, so a condition that never came true is reported by name,
not by pytest-timeout's stack dump.

Outside pytest (benchmarks reuse tests/ctl/parts.py) every wait gets `DEFAULT_S`.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")

DEFAULT_S = 900.0
"""What a wait gets outside a pytest test (no overall budget was started)."""
MAX_CONTENTION = 10.0
"""The most `contention()` stretches a budget: past that a hang guard would not guard."""
PROBE_CPU_S = 0.05
REPROBE_S = 30.0

_deadline: float | None = None
_probe: tuple[float, float] | None = None  # (when, factor) of the last measurement


def _busy_loop_slowdown(cpu_s: float = PROBE_CPU_S) -> float:
    """Wall seconds per CPU second of a short busy loop on this thread: 1 on an idle core, N
    when the scheduler gives this process 1/N of one (other processes, their priorities)."""
    wall0, cpu0 = time.perf_counter(), time.thread_time()
    while time.thread_time() - cpu0 < cpu_s:
        pass
    return (time.perf_counter() - wall0) / max(time.thread_time() - cpu0, 1e-9)


def contention() -> float:
    """How many times slower than on an idle machine work runs here now, measured: the larger
    of the 1-minute load average per usable CPU and a 50 ms busy loop's wall/CPU ratio, between
    1 and MAX_CONTENTION. Measured again at most every REPROBE_S seconds."""
    global _probe
    now = time.monotonic()
    if _probe is not None and now - _probe[0] < REPROBE_S:
        return _probe[1]
    cpus = len(os.sched_getaffinity(0)) or 1
    factor = max(1.0, os.getloadavg()[0] / cpus, _busy_loop_slowdown())
    _probe = (now, min(factor, MAX_CONTENTION))
    return _probe[1]


def scaled(seconds: float, factor: float) -> float:
    """A budget that was enough on an idle machine, stretched for one `factor` times slower."""
    return seconds * min(max(factor, 1.0), MAX_CONTENTION)


def margin(seconds: float) -> float:
    """How long before the timer a wait gives up: time to report and tear down."""
    return min(30.0, max(2.0, 0.05 * seconds))


def begin(seconds: float | None) -> None:
    """Start the running test's budget (None: it has none, waits get DEFAULT_S)."""
    global _deadline
    _deadline = None if seconds is None else time.monotonic() + seconds - margin(seconds)


def left() -> float:
    """Seconds left of the running test's budget (at least 0.1: a last look, never a block)."""
    if _deadline is None:
        return DEFAULT_S
    return max(_deadline - time.monotonic(), 0.1)


class BudgetSpent(AssertionError):
    """A condition did not come true within the test's overall budget."""


def described(predicate: Callable[..., object]) -> str:
    """A predicate's name, or a lambda's own source line, to name it in a failure."""
    name = getattr(predicate, "__name__", "<lambda>")
    if name != "<lambda>":
        return name
    try:
        return inspect.getsource(predicate).strip()
    except (OSError, TypeError):
        return repr(predicate)


def _spent(what: str, started: float, detail: Callable[[], str] | None) -> BudgetSpent:
    extra = f"; {detail()}" if detail is not None else ""
    return BudgetSpent(
        f"{what}: not seen after {time.monotonic() - started:.0f} s, the test's whole budget{extra}"
    )


def until(
    predicate: Callable[[], T | None],
    what: str | None = None,
    *,
    every: float = 0.05,
    detail: Callable[[], str] | None = None,
) -> T:
    """Poll `predicate` until it returns something truthy (returned) or the budget is spent
    (BudgetSpent naming `what`, else the predicate's source, with `detail()` when given)."""
    what = what or described(predicate)
    started = time.monotonic()
    end = started + left()
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= end:
            raise _spent(what, started, detail)
        time.sleep(every)


async def until_async(
    predicate: Callable[[], T | None],
    what: str | None = None,
    *,
    every: float = 0.05,
    pause: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    detail: Callable[[], str] | None = None,
) -> T:
    """`until` for async tests: `pause` between looks (a Textual pilot's `pause`, so the app
    runs meanwhile)."""
    what = what or described(predicate)
    started = time.monotonic()
    end = started + left()
    while True:
        got = predicate()
        if got:
            return got
        if time.monotonic() >= end:
            raise _spent(what, started, detail)
        await pause(every)


async def until_awaited(
    predicate: Callable[[], Awaitable[T | None]],
    what: str | None = None,
    *,
    every: float = 0.1,
    detail: Callable[[], str] | None = None,
) -> T:
    """`until_async` for a predicate that must be awaited (a status call over a transport)."""
    what = what or getattr(predicate, "__name__", None) or described(predicate)
    started = time.monotonic()
    end = started + left()
    while True:
        got = await predicate()
        if got:
            return got
        if time.monotonic() >= end:
            raise _spent(what, started, detail)
        await asyncio.sleep(every)


def wait(proc: subprocess.Popen[Any], what: str) -> int:
    """`proc.wait()` within the budget; a process still running then is BudgetSpent."""
    started = time.monotonic()
    try:
        return proc.wait(left())
    except subprocess.TimeoutExpired:
        raise _spent(what, started, None) from None
