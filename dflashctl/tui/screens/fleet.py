"""Fleet screen: one row per host, the table the seed's user assembled by hand from tmux captures.

A group (a multi-node run) is one row that opens into its nodes' rows, like a tree's node:
`space` toggles it. Textual's DataTable has no child rows and adds rows only at the end, so
opening or closing a group rebuilds the table in the new row order (a handful of rows, only on
that key); every other tick updates only the cells that changed.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar, Literal

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.coordinate import Coordinate
from textual.widgets import DataTable, Footer, Header, Static

from dflashctl.humanize import format_age
from dflashctl.monitor.evals import best_checkpoint, last_eval
from dflashctl.monitor.state import RunState, display_state, line_age, restart_summary
from dflashctl.tui.group_rows import group_figures, node_display, node_step
from dflashctl.tui.view import LiveScreen
from dflashctl.tui.widgets.panes import DASH, fmt, state_style
from trainer.events import format_eta

COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("host", "Host", 0),  # 0: sized to the longest host name
    ("state", "State", 18),
    ("release", "Release", 12),
    ("step", "Step", 7),
    ("loss", "Loss", 7),
    ("tau", "Tau", 5),
    ("ktok", "Ktok/s", 6),
    ("eta", "ETA", 5),
    ("age", "Last line", 9),
    ("config", "Config", 7),
    ("restarts", "Restarts", 20),
)
"""Fixed widths: auto-sized columns re-measure the table on every cell update and redraw
rows drawn at older widths. Each fits its values (steps to 7 digits, `12.3456`, `2.81*`,
`1234.5`, `12.3d`, `changed`): 123 columns, a restart summary still whole at 120."""
GROUP_STATE_WIDTH = 24
"""The state column where the inventory has groups (their states and "unreachable since T"
are longer than a host's)."""


def tau_cell(state: RunState) -> Text | str:
    """The held-out tau of the last eval (`monitor.last_eval`, as the eval pane reads it),
    `2.81*` in the best's colour when that eval is the best so far (`monitor.best_checkpoint`);
    a dash before any eval."""
    newest = last_eval(state)
    if newest is None or newest.tau is None:
        return DASH
    best = best_checkpoint(state)
    tau = f"{newest.tau:.{2 if newest.tau < 10 else 1}f}"  # 4 characters, and the mark
    if best is not None and best.step == newest.step:
        return Text(f"{tau}*", style="bold yellow")
    return tau


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
        "tau": tau_cell(state),
        "ktok": fmt(st.ktok_s if st else None, ".1f"),
        "eta": format_eta(st.eta_s) if st else DASH,
        "age": format_age(line_age(state, now)),
        "config": Text("changed", style="bold magenta") if state.config_changed else "",
        "restarts": restart_summary(state, now, compact=True) or "",
    }


def group_row(
    name: str, nodes: Sequence[RunState], now: float, *, expanded: bool = False
) -> dict[str, Text | str]:
    """A group's one row (`group_rows.group_figures`): its state, and node 0's step, loss,
    held-out tau (global rank 0 evaluates), Ktok/s (the whole group's: the trainer counts every
    rank's tokens there) and ETA."""
    fig = group_figures(name, nodes, now)
    st = fig.status
    return {
        "host": Text(f"{'▾' if expanded else '▸'} {name}", style="bold"),
        "state": Text(fig.state, style=state_style(fig.state)),
        "release": fig.release or DASH,
        "step": DASH if fig.step is None else str(fig.step),
        "loss": fmt(st.loss if st else None, ".4f"),
        "tau": tau_cell(nodes[0]),
        "ktok": fmt(st.ktok_s if st else None, ".1f"),
        "eta": format_eta(st.eta_s) if st else DASH,
        "age": format_age(fig.line_age),
        "config": Text("changed", style="bold magenta") if fig.config_changed else "",
        "restarts": f"{len(nodes)} nodes",
    }


def node_row(state: RunState, node_rank: int, now: float, *, last: bool) -> dict[str, Text | str]:
    """A node's row under its group: its own state ("unreachable since T"), step and release;
    loss, Ktok/s and ETA only where it prints status lines (node 0)."""
    cells = fleet_row(state, now)
    shown = node_display(state, node_rank, now)
    step = node_step(state)
    return {
        **cells,
        "host": f"  {'└' if last else '├'} {state.host}",
        "state": Text(shown, style=state_style(shown)),
        "step": DASH if step is None else str(step),
        "restarts": cells["restarts"] or f"node {node_rank}",
    }


def cursor_row_key(table: DataTable[Text | str]) -> str | None:
    """The key of the row under `table`'s cursor (None on an empty table)."""
    if table.row_count == 0:
        return None
    row_key, _ = table.coordinate_to_cell_key(Coordinate(table.cursor_row, 0))
    return None if row_key.value is None else str(row_key.value)


def update_changed_cells(
    table: DataTable[Text | str],
    row: str,
    columns: Sequence[tuple[str, str, int]],
    cells: Mapping[str, Text | str],
    shown: Mapping[str, Text | str],
) -> None:
    """Update the cells of `row` that differ from those `shown`: each update costs a row
    redraw, so no-ops are skipped."""
    for key, _, _ in columns:
        if cells[key] != shown[key]:
            table.update_cell(row, key, cells[key])


RowKind = Literal["host", "group", "node"]


class FleetScreen(LiveScreen[None]):
    """The overview; `enter` drills into a host (or a group), `space` opens a group's node rows,
    the app's keys act on the highlighted host."""

    BINDINGS: ClassVar[list[BindingType]] = [
        ("enter", "open_host", "Open host"),
        Binding("space", "toggle_group", "Nodes", tooltip="Open or close a group's node rows"),
    ]

    _ready = False

    def __init__(self) -> None:
        super().__init__()
        self._shown: dict[str, dict[str, Text | str]] = {}
        self._order: list[str] | None = None
        self.expanded: set[str] = set()
        """Groups whose node rows are shown (a tree's open nodes)."""

    def on_mount(self) -> None:
        self._ready = True
        self.request_redraw()

    def compose(self) -> ComposeResult:
        yield Header(show_clock=False)
        yield Static("", id="fleet-summary")
        table: DataTable[Text | str] = DataTable(id="fleet", cursor_type="row", zebra_stripes=True)
        groups = self.view.groups
        in_group = {h for nodes in groups.values() for h in nodes}
        widths = [4, *(len(h) for h in self.view.hosts if h not in in_group)]
        widths += [len(g) + 2 for g in groups] + [len(h) + 4 for h in in_group]
        for key, label, width in COLUMNS:
            if key == "state" and groups:
                width = GROUP_STATE_WIDTH  # "degraded: NODE unreachable", "unreachable since T"
            table.add_column(label, key=key, width=width or max(widths))
        yield table
        yield Footer()

    @property
    def table(self) -> DataTable[Text | str]:
        return self.query_one("#fleet", DataTable)

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action == "toggle_group":
            return bool(self.view.groups)  # no groups: the key is not offered
        return True

    def rows(self) -> list[tuple[RowKind, str]]:
        """(kind, name) of each table row in order: hosts in inventory order, a group in its
        node 0's place, its nodes after it (rank order) when it is open."""
        groups = self.view.groups
        member = {h: g for g, nodes in groups.items() for h in nodes}
        out: list[tuple[RowKind, str]] = []
        for host in self.view.hosts:
            group = member.get(host)
            if group is None:
                out.append(("host", host))
            elif groups[group][0] == host:
                out.append(("group", group))
                if group in self.expanded:
                    out.extend(("node", h) for h in groups[group])
        return out

    def selected_key(self) -> str | None:
        return cursor_row_key(self.table)

    def selected_host(self) -> str | None:
        """The highlighted host (a node row is its host); None on a group's row."""
        key = self.selected_key()
        return key if key is not None and key in self.view.hosts else None

    def selected_group(self) -> str | None:
        key = self.selected_key()
        return key if key is not None and key in self.view.groups else None

    def _cells(
        self, kind: RowKind, name: str, states: Mapping[str, RunState], now: float
    ) -> dict[str, Text | str]:
        if kind == "host":
            return fleet_row(states.get(name) or RunState(name), now)
        groups = self.view.groups
        if kind == "group":
            nodes = [states.get(h) or RunState(h) for h in groups[name]]
            return group_row(name, nodes, now, expanded=name in self.expanded)
        group = next(g for g, nodes in groups.items() if name in nodes)
        rank = groups[group].index(name)
        last = rank == len(groups[group]) - 1
        return node_row(states.get(name) or RunState(name), rank, now, last=last)

    def refresh_view(
        self, states: Mapping[str, RunState], now: float, dirty: Iterable[str]
    ) -> None:
        """Update every row: ages change every tick even when no line arrived. A group opened
        or closed rebuilds the table in the new row order (the highlighted row stays)."""
        if not self._ready:
            return
        del dirty  # the age column changes for all hosts on every tick
        table = self.table
        rows = self.rows()
        order = [name for _, name in rows]
        if order != self._order:
            keep = self.selected_key() if self._order else None
            table.clear()
            self._shown = {}
            for kind, name in rows:
                cells = self._cells(kind, name, states, now)
                table.add_row(*(cells[k] for k, _, _ in COLUMNS), key=name)
                self._shown[name] = cells
            self._order = order
            if keep in order:
                table.move_cursor(row=order.index(keep), animate=False)
        else:
            for kind, name in rows:
                cells = self._cells(kind, name, states, now)
                update_changed_cells(table, name, COLUMNS, cells, self._shown[name])
                self._shown[name] = cells
        counts: dict[str, int] = {}
        for state in states.values():
            label = display_state(state, now).split(" ")[0]
            counts[label] = counts.get(label, 0) + 1
        summary = Text(f" {len(states)} hosts  ")
        for name, n in sorted(counts.items()):
            summary.append(f"{name} {n}  ", style=state_style(name))
        if self.view.groups:
            n = len(self.view.groups)
            summary.append(
                f"{n} group{'s' if n > 1 else ''} (space: nodes; a group's Ktok/s is node 0's,"
                " which counts every rank)",
                style="dim",
            )
        self.query_one("#fleet-summary", Static).update(summary)

    def action_toggle_group(self) -> None:
        """Open or close the highlighted group (on a node row: close its group)."""
        key = self.selected_key()
        groups = self.view.groups
        group = key if key in groups else next((g for g, n in groups.items() if key in n), None)
        if group is None:
            return
        if group in self.expanded:
            self.expanded.discard(group)
        else:
            self.expanded.add(group)
        self.refresh_view_now(select=group)

    def refresh_view_now(self, select: str | None = None) -> None:
        """Redraw now (the row order changed) and highlight `select`."""
        self.view.flush()
        if select is not None and self._order and select in self._order:
            self.table.move_cursor(row=self._order.index(select), animate=False)

    def _open(self, key: str | None) -> None:
        if key is None:
            return
        if key in self.view.groups:
            self.view.open_group(key)
        elif key in self.view.hosts:
            self.view.open_host(key)

    def action_open_host(self) -> None:
        self._open(self.selected_key())

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self._open(str(event.row_key.value))
