"""The TUI's view of the in-container supervisor: states, restarts on the row and header, toasts.

Fed from real `RunControl` status parses (`parse_status` over the status script's sections), so
the TUI reads exactly what `dflashctl status --json` reports.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

from dflashctl.monitor.state import RunState, apply_status, display_state, supervisor_events
from dflashctl.remote.run import MARK
from dflashctl.runs.snapshot import RunStatus, parse_status
from dflashctl.tui import app as app_module
from dflashctl.tui.app import DflashApp, HostBinding
from dflashctl.tui.screens.fleet import fleet_row
from dflashctl.tui.widgets.panes import header_text
from tests.tui.fixtures import FIXED_NOW, service
from trainer.config.policy import Policy


def restart(reason: str, at: str = "2027-01-15T07:56:55Z") -> dict[str, Any]:
    return {"at": at, "reason": reason, "exit_status": -9, "checkpoint_step": 40,
            "resumed_step": 40, "backoff_s": 1.0}  # fmt: skip


def polled(state: str, restarts: list[dict[str, Any]], pane: str = "0|||40", **kw: Any) -> Any:
    sup = {"pid": 40, "trainer_pid": 41, "state": state, "attempt": len(restarts) + 1,
           "policy": Policy().as_json(), "restarts": restarts, "gave_up": state == "gave-up", **kw}  # fmt: skip
    sections = {"session": "yes", "pane": pane, "current": "releases/r1", "log_lines": "0",
                "supervisor": json.dumps(sup), "supervisable": "yes"}  # fmt: skip
    return parse_status("h", "".join(f"{MARK}{k}\n{v}\n" for k, v in sections.items()), str)


def test_states_and_restarts_reach_the_row_and_the_header() -> None:
    s = apply_status(RunState("h"), polled("restarting", [restart("signal 9")]))
    assert display_state(s, FIXED_NOW) == "restarting"
    row = fleet_row(s, FIXED_NOW)
    assert str(row["state"]) == "restarting" and row["restarts"] == "1× signal 9 3m05s"
    assert "restarts 1× signal 9, 3m05s ago" in header_text(s, FIXED_NOW).plain
    gave = apply_status(
        s, polled("gave-up", [restart("exit 1")] * 2, pane="1|1||40", detail="gave up after 2")
    )
    assert display_state(gave, FIXED_NOW) == "gave-up"
    assert "supervisor: gave up after 2" in header_text(gave, FIXED_NOW).plain


def test_an_unreachable_poll_keeps_what_was_known() -> None:
    s = apply_status(RunState("h"), polled("running", [restart("signal 9")]))
    lost = apply_status(s, RunStatus(host="h", state="unreachable", message="ssh: timed out"))
    assert display_state(lost, FIXED_NOW) == "unreachable"
    assert lost.restarts == s.restarts and fleet_row(lost, FIXED_NOW)["restarts"]
    assert supervisor_events(s, lost) == []  # a lost link is no restart and no crash


def test_each_new_restart_is_one_event_and_history_is_not_news() -> None:
    first = apply_status(RunState("h"), polled("running", [restart("exit 1")]))
    assert supervisor_events(RunState("h"), first) == []  # the first poll: history
    again = apply_status(first, polled("running", [restart("exit 1")]))
    assert supervisor_events(first, again) == []
    two = apply_status(again, polled("restarting", [restart("exit 1"), restart("signal 9")]))
    assert supervisor_events(again, two) == [
        ("warning", "h: trainer restarted (signal 9, resumed from step 40); restart 2 of 3")
    ]
    gave = apply_status(
        two, polled("gave-up", [restart("exit 1")] * 2, pane="1|1||40", detail="gave up after 2")
    )
    assert supervisor_events(two, gave) == [("error", "h: supervisor gave up after 2")]


class Recording(DflashApp):
    CSS_PATH = str(Path(app_module.__file__).parent / "dflashctl.tcss")

    def __init__(self, *a: Any, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.toasts: list[tuple[str, str]] = []

    def notify(self, message: str, *a: Any, severity: str = "information", **kw: Any) -> None:
        self.toasts.append((severity, message))
        super().notify(message, *a, severity=severity, **kw)  # type: ignore[arg-type]


async def test_the_app_toasts_each_new_restart_once() -> None:
    app = Recording([HostBinding("h", service())], clock=lambda: FIXED_NOW, live=False)
    async with app.run_test(size=(120, 30)) as pilot:
        base = apply_status(RunState("h"), polled("running", []))
        app.set_state(base)
        one = apply_status(base, polled("restarting", [restart("signal 9")]))
        app.set_state(one)
        app.set_state(replace(one, lines_seen=5))  # the same restart again: no second toast
        await pilot.pause()
        assert app.toasts == [
            ("warning", "h: trainer restarted (signal 9, resumed from step 40); restart 1 of 3")
        ]
