"""The one log-tail widget: the host screen's log pane and the full log screen."""

from __future__ import annotations

from textual.widgets import Log

from dflashctl.monitor.state import RunState


class TailLog(Log):
    """A `Log` that follows a host's bounded `RunState.log_tail`, writing only what is new.

    `show(state)` appends the lines that arrived since the last call; when the tail was replaced
    (a new run, more new lines than the tail holds, or the first call) it redraws it whole.
    """

    def __init__(self, max_lines: int, *, id: str | None = None) -> None:
        super().__init__(max_lines=max_lines, auto_scroll=True, id=id)
        self._seen = 0

    def show(self, state: RunState) -> None:
        new = state.lines_seen - self._seen
        if new == 0:
            return
        if new < 0 or new >= len(state.log_tail) or self._seen == 0:
            self.clear()
            tail = state.log_tail
            self.write_lines(tail if self.max_lines is None else tail[-self.max_lines :])
        else:
            self.write_lines(state.log_tail[-new:])
        self._seen = state.lines_seen
