"""Full log screen: the host's bounded log tail, following new lines."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import BindingType
from textual.screen import Screen
from textual.widgets import Footer, Log, Static

from dflashctl.monitor import LOG_TAIL, RunState


class LogScreen(Screen[None]):
    """Every line the app kept for one host (status, phases, errors, tracebacks)."""

    BINDINGS: ClassVar[list[BindingType]] = [("escape", "app.pop_screen", "Back")]

    def __init__(self, host: str) -> None:
        super().__init__(name=f"log:{host}")
        self.host = host
        self._seen = 0
        self._ready = False

    def on_mount(self) -> None:
        self._ready = True
        self.app.call_later(self.app.flush)  # type: ignore[attr-defined]

    def compose(self) -> ComposeResult:
        yield Static(f" log: {self.host}  (last {LOG_TAIL} lines kept)", id="log-title")
        yield Log(max_lines=LOG_TAIL, auto_scroll=True, id="full-log")
        yield Footer()

    def refresh_view(self, states: dict[str, RunState], now: float, dirty: Iterable[str]) -> None:
        if not self._ready:
            return
        del now, dirty
        state = states.get(self.host)
        if state is None:
            return
        log = self.query_one("#full-log", Log)
        new = state.lines_seen - self._seen
        if new == 0:
            return
        if new < 0 or new >= len(state.log_tail) or self._seen == 0:
            log.clear()
            log.write_lines(state.log_tail)
        else:
            log.write_lines(state.log_tail[-new:])
        self._seen = state.lines_seen
