"""tests/budget.py: one overall budget per test, stretched by the measured load."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
import pytest_timeout

from tests import budget, conftest


def test_until_returns_what_came_true_and_names_what_never_did() -> None:
    seen = iter([None, 0, "", "ready"])
    assert budget.until(lambda: next(seen), "the fourth look", every=0.01) == "ready"
    budget.begin(2.5)  # 0.5 s after the 2 s margin: this test's own budget, shortened
    t0 = time.monotonic()
    with pytest.raises(budget.BudgetSpent, match=r"the moon: not seen after \d+ s.*still dark"):
        budget.until(lambda: False, "the moon", detail=lambda: "still dark")
    assert time.monotonic() - t0 < 60  # it ended with the budget, not at DEFAULT_S


async def test_until_async_lets_other_tasks_run_between_looks() -> None:
    import asyncio

    flag = asyncio.Event()
    asyncio.get_running_loop().call_later(0.05, flag.set)
    assert await budget.until_async(flag.is_set, "the flag", every=0.01)


def test_wait_names_the_process_still_running_when_the_budget_is_spent() -> None:
    budget.begin(2.2)
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) as proc:
        try:
            with pytest.raises(budget.BudgetSpent, match="the sleeper"):
                budget.wait(proc, "the sleeper")
        finally:
            proc.kill()
    budget.begin(None)
    assert budget.left() == budget.DEFAULT_S  # outside a test's budget: the default


def test_contention_is_measured_between_1_and_the_cap() -> None:
    assert 1.0 <= budget.contention() <= budget.MAX_CONTENTION
    assert budget.scaled(60, 0.5) == 60  # an idle machine keeps the timeout as written
    assert budget.scaled(60, 3) == 180
    assert budget.scaled(60, 1e6) == 60 * budget.MAX_CONTENTION


@pytest.mark.timeout(40)
def test_each_test_runs_under_its_timeout_stretched_by_the_load(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hook in tests/conftest.py started this test's budget from its marker, and starts
    pytest-timeout's own timer with the same stretched value (here: a machine 3x slower)."""
    assert 40 - budget.margin(40) - 10 < budget.left() <= 40 * budget.MAX_CONTENTION
    monkeypatch.setattr(budget, "contention", lambda: 3.0)
    settings = pytest_timeout.Settings(7.0, "signal", False, False)
    try:
        assert conftest.pytest_timeout_set_timer(request.node, settings)
        assert signal.getitimer(signal.ITIMER_REAL)[0] == pytest.approx(21.0, abs=1.0)
        assert budget.left() == pytest.approx(21.0 - budget.margin(21.0), abs=1.0)
    finally:
        request.node.cancel_timeout()
