"""Fleet screen: one row per host, the table the seed's user assembled by hand from tmux captures."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Footer, Header, Static

from dflashctl.monitor import RunState, display_state, format_age, line_age, restart_summary
from dflashctl.tui.view import LiveScreen
from dflashctl.tui.widgets.panes import DASH, fmt, state_style
from trainer.events import format_eta

COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("host", "Host", 0),  # 0: sized to the longest host name
    ("state", "State", 18),
    ("release", "Release", 12),
    ("step", "Step", 9),
    ("loss", "Loss", 8),
    ("ktok", "Ktok/s", 7),
    ("eta", "ETA", 6),
    ("age", "Last line", 9),
    ("config", "Config", 8),
    ("restarts", "Restarts", 20),
)
"""Fixed widths: auto-sized columns re-measure the table on every cell update and redraw
rows drawn at older widths."""


def fleet_row(state: RunState, now: float) -> dict[str, Text | str]:
    """The cells of one host's row (pure, so tests check values without rendering)."""
    st = state.status
    shown = display_state(state, now)
    return {
        "host": state.host,
        "state": Text(shown, style=state_style(shown)),
        "release": state.release or DASH,
        "step": str(st.step) if st else DASH,
        "loss": fmt(st.loss if st else None, ".4f"),
        "ktok": fmt(st.ktok_s if st else None, ".1f"),
        "eta": format_eta(st.eta_s) if st else DASH,
        "age": format_age(line_age(state, now)),
        "config": Text("changed", style="bold magenta") if state.config_changed else "",
        "restarts": restart_summary(state, now, compact=True) or "",
    }


class FleetScreen(LiveScreen[None]):
    """The overview; `enter` drills into a host, the app's keys act on the highlighted one."""

    BINDINGS: ClassVar[list[BindingType]] = [("enter", "open_host", "Open host")]

    _ready = False

    def __init__(self) -> None:
        super().__init__()
        self._shown: dict[str, dict[str, Text | str]] = {}

    def on_mount(self) -> None:
        self._ready = True
        self.request_redraw()

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Static("", id="fleet-summary")
        table: DataTable[Text | str] = DataTable(id="fleet", cursor_type="row", zebra_stripes=True)
        host_width = max([4, *(len(h) for h in self.view.hosts)])
        for key, label, width in COLUMNS:
            table.add_column(label, key=key, width=width or host_width)
        yield table
        yield Footer()

    @property
    def table(self) -> DataTable[Text | str]:
        return self.query_one("#fleet", DataTable)

    def selected_host(self) -> str | None:
        table = self.table
        if table.row_count == 0:
            return None
        row_key, _ = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0))
        return None if row_key.value is None else str(row_key.value)

    def refresh_view(
        self, states: Mapping[str, RunState], now: float, dirty: Iterable[str]
    ) -> None:
        if not self._ready:
            return
        """Update every row: ages change every tick even when no line arrived."""
        del dirty  # the age column changes for all hosts on every tick
        table = self.table
        for host, state in states.items():
            cells = fleet_row(state, now)
            shown = self._shown.get(host)
            if shown is None:
                table.add_row(*(cells[k] for k, _, _ in COLUMNS), key=host)
                self._shown[host] = cells
                continue
            for key, _, _ in COLUMNS[1:]:
                if cells[key] != shown[key]:  # each update costs a row redraw: skip no-ops
                    table.update_cell(host, key, cells[key])
            self._shown[host] = cells
        counts: dict[str, int] = {}
        for state in states.values():
            label = display_state(state, now).split(" ")[0]
            counts[label] = counts.get(label, 0) + 1
        summary = Text(f" {len(states)} hosts  ")
        for name, n in sorted(counts.items()):
            summary.append(f"{name} {n}  ", style=state_style(name))
        self.query_one("#fleet-summary", Static).update(summary)

    def action_open_host(self) -> None:
        host = self.selected_host()
        if host is not None:
            self.view.open_host(host)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self.view.open_host(str(event.row_key.value))
