"""Group screen: one multi-node run, its nodes in rank order, every node's GPU pane, and the
queues as node 0's status line has them (its own q_pre; q_hs one entry per rank, every node's,
gathered by the step's reduce)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import ClassVar

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import DataTable, Footer, Static

from dflashctl.humanize import format_age
from dflashctl.monitor.state import RunState, line_age
from dflashctl.tui.group_rows import group_figures, node_display, node_step
from dflashctl.tui.screens.fleet import cursor_row_key, update_changed_cells
from dflashctl.tui.view import LiveScreen
from dflashctl.tui.widgets.panes import DASH, Pane, fmt, gpus_text, queues_text, state_style
from trainer.events import format_eta

NODE_COLUMNS: tuple[tuple[str, str, int], ...] = (
    ("node", "Node", 4),
    ("host", "Host", 0),  # 0: sized to the longest node name
    ("state", "State", 26),
    ("ranks", "Ranks", 7),
    ("step", "Step", 9),
    ("release", "Release", 12),
    ("age", "Last line", 9),
)


def group_header(name: str, nodes: Sequence[RunState], now: float) -> Text:
    """One line: the group, its state, world size, and node 0's step, loss, Ktok/s, ETA."""
    fig = group_figures(name, nodes, now)
    st = fig.status
    out = Text()
    out.append(f" {name} ", style="bold reverse")
    out.append("  ")
    out.append(fig.state, style=state_style(fig.state))
    world = fig.view.world_size
    parts = [
        ("nodes", str(len(nodes))),
        ("world", DASH if world is None else str(world)),
        ("step", DASH if fig.step is None else str(fig.step)),
        ("loss", fmt(st.loss if st else None, ".4f")),
        ("Ktok/s (all ranks)", fmt(st.ktok_s if st else None, ".1f")),
        ("ETA", format_eta(st.eta_s) if st and st.eta_s is not None else DASH),
    ]
    for key, value in parts:
        out.append("  ")
        out.append(f"{key} ", style="dim")
        out.append(value, style="bold")
    view = fig.view
    if view.state in ("gave-up", "failed") or view.failed is not None:
        out.append(f"\n {view.summary()}", style="red")
    elif view.state in ("restarting", "rendezvous") or view.history:
        out.append(f"\n {view.summary()}", style="yellow")
    for a in view.history[-3:]:  # the last attempts that failed, newest last
        after = "resumed" if a.resumed else "restarting" if a.restarted else "not restarted"
        out.append(f"\n   {a.line()} -> {after}", style="dim")
    return out


def node_cells(state: RunState, node_rank: int, now: float) -> dict[str, Text | str]:
    shown = node_display(state, node_rank, now)
    step = node_step(state)
    ranks = state.run_info.rank_range
    return {
        "node": str(node_rank),
        "host": state.host,
        "state": Text(shown, style=state_style(shown)),
        "ranks": f"{ranks[0]}-{ranks[1] - 1}" if ranks is not None and len(ranks) == 2 else DASH,
        "step": DASH if step is None else str(step),
        "release": state.release or DASH,
        "age": format_age(line_age(state, now)),
    }


class GroupScreen(LiveScreen[None]):
    """A group's nodes (rank order; `enter` opens a node's host screen) and each node's GPUs."""

    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "app.pop_screen", "Fleet"),
        ("enter", "open_node", "Open node"),
    ]

    def __init__(self, group: str) -> None:
        super().__init__(name=group)
        self.group = group
        self._ready = False
        self._shown: dict[str, dict[str, Text | str]] = {}
        self._queues_painted = False

    @property
    def nodes(self) -> tuple[str, ...]:
        return self.view.groups[self.group]

    def compose(self) -> ComposeResult:
        yield Static("", id="group-header")
        table: DataTable[Text | str] = DataTable(
            id="group-nodes", cursor_type="row", zebra_stripes=True
        )
        width = max(4, *(len(h) for h in self.nodes))
        for key, label, w in NODE_COLUMNS:
            table.add_column(label, key=key, width=w or width)
        yield table
        with Horizontal(id="group-body"):
            yield Pane("queues (node 0's line: q_hs has every rank's)", id="group-queues")
            with VerticalScroll(id="group-gpus"):
                for rank, host in enumerate(self.nodes):
                    yield Pane(f"node {rank}: {host} GPUs", id=f"gpus-{rank}", classes="node-gpus")
        yield Footer()

    def on_mount(self) -> None:
        self._ready = True
        self.request_redraw()

    @property
    def table(self) -> DataTable[Text | str]:
        return self.query_one("#group-nodes", DataTable)

    def selected_host(self) -> str | None:
        return cursor_row_key(self.table)

    def refresh_view(
        self, states: Mapping[str, RunState], now: float, dirty: Iterable[str]
    ) -> None:
        if not self._ready:
            return
        nodes = [states.get(h) or RunState(h) for h in self.nodes]
        self.query_one("#group-header", Static).update(group_header(self.group, nodes, now))
        table = self.table
        changed = set(dirty)
        for rank, state in enumerate(nodes):
            cells = node_cells(state, rank, now)
            shown = self._shown.get(state.host)
            if shown is None:
                table.add_row(*(cells[k] for k, _, _ in NODE_COLUMNS), key=state.host)
            else:
                update_changed_cells(table, state.host, NODE_COLUMNS, cells, shown)
            self._shown[state.host] = cells
            if not self._queues_painted or state.host in changed:  # (before layout: each tick)
                self.query_one(f"#gpus-{rank}", Static).update(
                    gpus_text(state, now, self._width(f"#gpus-{rank}"))
                )
        queues = self.query_one("#group-queues", Static)
        width = queues.content_size.width
        node0 = nodes[0]
        if width and (not self._queues_painted or node0.host in changed):
            shape = self.view.shape_for(node0.host)
            queues.update(queues_text(node0, shape, max(8, width)))
            self._queues_painted = True

    def _width(self, selector: str) -> int:
        return max(24, self.query_one(selector).content_size.width)

    def on_resize(self) -> None:
        self._queues_painted = False  # the gauges are sized to the pane
        self.request_redraw()

    @property
    def painted(self) -> bool:
        """True once the queues pane was drawn at its laid-out size (tests wait for it)."""
        return self._queues_painted

    def action_open_node(self) -> None:
        host = self.selected_host()
        if host is not None:
            self.view.open_host(host)

    def on_data_table_row_selected(self, event: DataTable.RowSelected) -> None:
        if event.row_key.value is not None:
            self.view.open_host(str(event.row_key.value))
