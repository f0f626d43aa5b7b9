"""Full log screen: the host's bounded log tail, following new lines."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import BindingType
from textual.widgets import Footer, Static

from dflashctl.monitor.state import LOG_TAIL, RunState
from dflashctl.tui.view import LiveScreen
from dflashctl.tui.widgets.tail_log import TailLog


class LogScreen(LiveScreen[None]):
    """Every line the app kept for one host (status, phases, errors, tracebacks)."""

    BINDINGS: ClassVar[list[BindingType]] = [("escape", "app.pop_screen", "Back")]

    def __init__(self, host: str) -> None:
        super().__init__(name=f"log:{host}")
        self.host = host
        self._ready = False

    def on_mount(self) -> None:
        self._ready = True
        self.request_redraw()

    def compose(self) -> ComposeResult:
        yield Static(f" log: {self.host}  (last {LOG_TAIL} lines kept)", id="log-title")
        yield TailLog(LOG_TAIL, id="full-log")
        yield Footer()

    def refresh_view(
        self, states: Mapping[str, RunState], now: float, dirty: Iterable[str]
    ) -> None:
        if not self._ready:
            return
        del now, dirty
        state = states.get(self.host)
        if state is None:
            return
        self.query_one("#full-log", TailLog).show(state)
