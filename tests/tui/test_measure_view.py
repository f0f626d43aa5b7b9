"""A `dflashctl measure` running on a host, as the TUI shows it: folded from status polls
(`RunStatus.measure`), "measuring" in the fleet row, one line on the host screen, gone with the
first poll that no longer reports it, and `r` refused before start would refuse it."""

from __future__ import annotations

from dataclasses import replace

from rich.text import Text
from textual.message import Message
from textual.notifications import Notify
from textual.widgets import Static

from dflashctl.monitor.state import RunState, apply_lines, apply_status, display_state
from dflashctl.runs.snapshot import RunningMeasure, RunStatus
from dflashctl.tui.app import DflashApp, HostBinding
from dflashctl.tui.group_rows import group_figures
from dflashctl.tui.screens.fleet import fleet_row
from dflashctl.tui.screens.host import HostScreen
from dflashctl.tui.screens.restart import RestartScreen
from dflashctl.tui.widgets.panes import header_text, measure_text, state_style
from tests import budget
from tests.tui.fixtures import FIXED_NOW, Status, run_lines, seed_shape, service

MEASURE = RunningMeasure(
    id="20261201T170211Z",
    session="dflash-measure",
    since="2026-12-01 17:02:11 UTC",
    age_s=725.0,
    progress="round 1/2 packed: 17,412 tok/s (run 4 of 10)",
)


def _stopped_run() -> RunState:
    """A host whose run stopped after 20 status lines (the state a measure finds)."""
    state = apply_lines(RunState("kpro6"), run_lines(20), FIXED_NOW - 900)
    return replace(apply_status(state, Status(state="stopped", exit_status=0)), link="live")


def _plain(cell: Text | str) -> str:
    return cell.plain if isinstance(cell, Text) else cell


def test_a_polled_measure_folds_in_and_goes_with_the_first_poll_without_it() -> None:
    idle = _stopped_run()
    measuring = apply_status(idle, Status(state="stopped", exit_status=0, measure=MEASURE))
    assert measuring.measure == MEASURE and idle.measure is None  # a new state, idle untouched
    assert display_state(idle, FIXED_NOW) == "stopped"
    assert display_state(measuring, FIXED_NOW) == "measuring"

    before, row = fleet_row(idle, FIXED_NOW), fleet_row(measuring, FIXED_NOW)
    state = row["state"]
    assert isinstance(state, Text) and state.plain == "measuring"
    assert state.style == state_style("measuring") != state_style("stopped")
    others = {k: _plain(v) for k, v in row.items() if k != "state"}
    assert others == {k: _plain(v) for k, v in before.items() if k != "state"}  # kept as they are

    # an unreachable poll keeps what we knew (the host says unreachable, not measuring)
    lost = apply_status(
        measuring, RunStatus(host="kpro6", state="unreachable", message="timed out")
    )
    assert lost.measure == MEASURE and display_state(lost, FIXED_NOW) == "unreachable"
    # the first reachable poll without one: it ended (its result is `measure --result`'s)
    done = apply_status(lost, RunStatus(host="kpro6", state="stopped", exit_status=0))
    assert done.measure is None and display_state(done, FIXED_NOW) == "stopped"


def test_a_training_run_wins_over_a_reported_measure_and_a_crash_does_not() -> None:
    running = apply_status(_stopped_run(), Status(state="running", measure=MEASURE))
    assert display_state(replace(running, last_line_at=FIXED_NOW), FIXED_NOW) == "running"
    crashed = apply_status(_stopped_run(), Status(state="crashed", exit_status=1, measure=MEASURE))
    assert display_state(crashed, FIXED_NOW) == "measuring"  # the old crash is history


def test_measure_line_names_id_since_progress_and_the_commands() -> None:
    assert measure_text(_stopped_run()) is None
    state = apply_status(_stopped_run(), Status(state="stopped", measure=MEASURE))
    line = measure_text(state, width=160)
    assert line is not None
    assert line.plain == (
        " measure 20261201T170211Z since 17:02:11 UTC (12m05s ago): "
        "round 1/2 packed: 17,412 tok/s (run 4 of 10)  dflashctl measure kpro6 --result|--stop"
    )
    # narrower: the age goes, then the since (the id is the UTC start, the header says it),
    # then the progress line is cut; the commands always show
    line = measure_text(state, width=135)
    assert line is not None and "since 17:02:11 UTC: round" in line.plain
    line = measure_text(state, width=120)
    assert line is not None and line.plain.startswith(" measure 20261201T170211Z: round 1/2")
    assert "(run 4 of 10)" in line.plain and line.plain.endswith("--result|--stop")
    line = measure_text(state, width=90)
    assert line is not None and len(line.plain) == 90
    assert "packed: 17,…  dflashctl" in line.plain and line.plain.endswith("--result|--stop")
    fresh = replace(state, measure=replace(MEASURE, progress=None, age_s=None))
    line = measure_text(fresh, width=160)
    assert line is not None
    assert line.plain.startswith(" measure 20261201T170211Z since 17:02:11 UTC: no timing run")
    header = header_text(state, FIXED_NOW).plain
    assert "measuring since 17:02:11 UTC (12m05s ago)" in header


def test_a_group_measuring_on_node_0_says_so() -> None:
    n0 = apply_status(RunState("n0"), Status(state="stopped", measure=MEASURE))
    n1 = apply_status(RunState("n1"), Status(state="stopped"))
    assert group_figures("pair", [n0, n1], FIXED_NOW).state == "measuring: n0"
    assert group_figures("pair", [replace(n0, measure=None), n1], FIXED_NOW).state == "stopped"


async def _until(pilot, predicate) -> None:  # type: ignore[no-untyped-def]
    """Until `predicate` holds, the app running (and flushed) meanwhile, within the test's one
    budget."""

    async def pause(seconds: float) -> None:
        await pilot.pause(seconds)
        pilot.app.flush()

    await budget.until_async(predicate, pause=pause, every=0.02)


async def test_host_screen_line_shows_while_measuring_and_r_is_refused_first() -> None:
    app = DflashApp(
        [HostBinding("kpro6", service(), shape=seed_shape())], clock=lambda: FIXED_NOW, live=False
    )
    measuring = apply_status(_stopped_run(), Status(state="stopped", measure=MEASURE))
    seen: list[Message] = []
    async with app.run_test(size=(120, 40), message_hook=seen.append) as pilot:
        app.set_state(measuring)
        await pilot.pause()
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen))
        line = app.screen.query_one("#host-measure", Static)
        await _until(pilot, lambda: line.display)
        assert "20261201T170211Z" in str(line.content)

        await pilot.press("r")
        await pilot.pause()
        warnings = [
            m.notification.message
            for m in seen
            if isinstance(m, Notify) and m.notification.severity == "warning"
        ]
        assert len(warnings) == 1 and "measure 20261201T170211Z is running there" in warnings[0]
        assert "`dflashctl measure kpro6 --stop`" in warnings[0]
        assert not isinstance(app.screen, RestartScreen)

        app.set_state(apply_status(measuring, Status(state="stopped")))  # the poll: it ended
        await _until(pilot, lambda: not line.display)
        header = str(app.screen.query_one("#host-header", Static).content)
        assert "stopped" in header and "measuring" not in header
