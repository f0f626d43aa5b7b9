"""A group (multi-node run) in the TUI (issue 15 item 5): one fleet row that opens into its
nodes' rows, a group screen with every node's GPU pane, a node's host screen; one node
unreachable is that node "unreachable since T" and the group degraded, never crashed.

The inventory is a real hosts.toml with `[groups.pair]` (parsed by `dflashctl.config.inventory`); the
nodes' run-state.json is what the trainer's contract parser reads (node_rank, nnodes,
rank_range, step, failed_rank); node 0 alone prints status lines, as global rank 0 does.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path

from rich.text import Text
from textual.widgets import DataTable, Static

from dflashctl.config.inventory import parse_inventory
from dflashctl.monitor.state import RunState, apply_lines, apply_status
from dflashctl.tui.app import DflashApp, HostBinding, tui_groups, tui_hosts
from dflashctl.tui.group_rows import group_figures
from dflashctl.tui.screens.fleet import FleetScreen
from dflashctl.tui.screens.group import GroupScreen
from dflashctl.tui.screens.host import HostScreen
from tests.tui.fixtures import (
    FIXED_NOW,
    GROUP_INVENTORY,
    ReplayControl,
    Status,
    node_run_state,
    run_lines,
    seed_shape,
    service,
)
from tests.tui.test_app import SIZE, _cell, _until
from tests.tui.test_supervisor_view import Recording
from trainer.events import StatusEvent, parse_line

SINCE = time.strftime("%H:%MZ", time.gmtime(FIXED_NOW))


def _app(tmp_path: Path, **controls: ReplayControl) -> Recording:
    inventory = parse_inventory(GROUP_INVENTORY, tmp_path / "hosts.toml")
    names = tui_hosts(inventory, [])
    hosts = [HostBinding(n, service(controls[n]), shape=seed_shape()) for n in names]
    return Recording(hosts, clock=lambda: FIXED_NOW, groups=tui_groups(inventory, names))


def _nodes(n1: Status | None = None) -> dict[str, ReplayControl]:
    """n0 streams the run's status lines (global rank 0); n1 prints none, its step is in its
    run-state.json; solo is a host of its own."""
    return {
        "n0": ReplayControl(lines=run_lines(25), status_value=Status(run_state=node_run_state(0))),
        "n1": ReplayControl(status_value=n1 or Status(run_state=node_run_state(1))),
        "solo": ReplayControl(lines=run_lines(3)),
    }


def _rows(table: DataTable[Text | str]) -> list[str]:
    return [str(k.value) for k in table.rows]


def test_the_inventory_names_the_group_and_the_hosts_to_follow(tmp_path: Path) -> None:
    inventory = parse_inventory(GROUP_INVENTORY, tmp_path / "hosts.toml")
    assert tui_hosts(inventory, []) == ["n0", "n1", "solo"]
    assert tui_hosts(inventory, ["pair"]) == ["n0", "n1"]  # a group name follows its nodes
    assert tui_groups(inventory, ["n0", "n1"]) == {"pair": ("n0", "n1")}
    assert tui_groups(inventory, ["n1", "solo"]) == {}  # a group in part is not shown as one


async def test_the_group_is_one_row_that_opens_into_its_nodes(tmp_path: Path) -> None:
    app = _app(tmp_path, **_nodes())
    last = parse_line(run_lines(25)[-1])
    assert isinstance(last, StatusEvent) and last.ktok_s is not None
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet", DataTable)
        await _until(pilot, lambda: table.row_count == 2 and _cell(table, "pair", "step") == "720")
        assert _rows(table) == ["pair", "solo"]
        assert _cell(table, "pair", "host") == "▸ pair"
        assert _cell(table, "pair", "state") == "running"
        assert _cell(table, "pair", "ktok") == f"{last.ktok_s:.1f}"  # node 0's: all ranks
        assert _cell(table, "pair", "eta") == "5.1d"
        assert _cell(table, "pair", "restarts") == "2 nodes"
        summary = str(app.screen.query_one("#fleet-summary", Static).content)
        assert "a group's Ktok/s is node 0's, which counts every rank" in summary
        await pilot.press("space")  # open: its nodes' rows under it, in rank order
        await _until(pilot, lambda: table.row_count == 4)
        assert _rows(table) == ["pair", "n0", "n1", "solo"]
        assert _cell(table, "pair", "host") == "▾ pair" and table.cursor_row == 0
        assert _cell(table, "n1", "host") == "  └ n1" and _cell(table, "n0", "host") == "  ├ n0"
        assert _cell(table, "n1", "step") == "720"  # its run-state.json step
        assert _cell(table, "n1", "state") == "running"  # prints no lines: never "stale"
        assert _cell(table, "n1", "loss") == "—" and _cell(table, "n1", "ktok") == "—"
        assert _cell(table, "n1", "restarts") == "node 1"
        await pilot.press("down", "down")  # the node's row: the host keys act on n1
        assert isinstance(app.screen, FleetScreen) and app.current_host() == "n1"
        await pilot.press("r", "s", "d")  # but not the run commands: those are the group's
        await pilot.pause()
        toasts = [t for _, t in app.toasts]
        assert "n1 is node 1 of group pair: `dflashctl restart pair` acts on every node" in (
            " ".join(toasts)
        )
        assert isinstance(app.screen, FleetScreen)  # no restart modal, no stop confirmation
        await pilot.press("space")  # on a node row: closes its group, the group highlighted
        await _until(pilot, lambda: table.row_count == 2)
        assert app.screen.selected_group() == "pair" and app.current_host() is None
        await pilot.press("s")  # a host key on the group row says what to do instead
        await pilot.pause()
        assert any("pair is a group" in t for _, t in app.toasts)


async def test_the_group_screen_shows_every_node_and_opens_a_node(tmp_path: Path) -> None:
    app = _app(tmp_path, **_nodes())
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet", DataTable)
        await _until(pilot, lambda: _cell(table, "pair", "step") == "720")
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, GroupScreen))
        screen = app.screen
        assert isinstance(screen, GroupScreen)
        await _until(pilot, lambda: screen.table.row_count == 2)
        header = screen.query_one("#group-header", Static).content
        plain = header.plain if isinstance(header, Text) else str(header)
        assert "pair   running" in plain and "world 2" in plain and "step 720" in plain
        assert "Ktok/s (all ranks)" in plain
        assert [_cell(screen.table, h, "ranks") for h in ("n0", "n1")] == ["0-0", "1-1"]
        panes = [str(p.border_title) for p in screen.query(".node-gpus")]
        assert panes == ["node 0: n0 GPUs", "node 1: n1 GPUs"]
        await pilot.press("down", "enter")  # node 1's host screen: its queues and GPUs
        await _until(pilot, lambda: isinstance(app.screen, HostScreen))
        host = app.screen
        assert isinstance(host, HostScreen) and host.host == "n1"
        assert host.query_one("#queues") and host.query_one("#gpus")
        await _until(pilot, lambda: "node 1 of 2, ranks 1-1" in _header(host))
        assert "step 720" in _header(host)


def _header(screen: HostScreen) -> str:
    content = screen.query_one("#host-header", Static).content
    return content.plain if isinstance(content, Text) else str(content)


async def test_one_unreachable_node_is_that_node_never_the_group_crashed(tmp_path: Path) -> None:
    lost = Status(state="unreachable", release=None, message="n1: ssh: connect timed out")
    app = _app(tmp_path, **_nodes(n1=lost))
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet", DataTable)
        await _until(pilot, lambda: "unreachable" in _cell(table, "pair", "state"))
        assert _cell(table, "pair", "state") == "degraded: n1 unreachable"
        assert _cell(table, "pair", "step") == "720"  # node 0 trains on: its figures stay
        await pilot.press("space")
        await _until(pilot, lambda: table.row_count == 4)
        assert _cell(table, "n1", "state") == f"unreachable since {SINCE}"
        assert _cell(table, "n0", "state") == "running"
        states = [_cell(table, k, "state") for k in _rows(table)]
        assert not any(s.startswith(("crashed", "failed")) for s in states)
        app.screen.query_one("#fleet", DataTable).move_cursor(row=0)
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, GroupScreen))
        screen = app.screen
        assert isinstance(screen, GroupScreen)
        await _until(pilot, lambda: screen.table.row_count == 2)
        assert _cell(screen.table, "n1", "state") == f"unreachable since {SINCE}"


def test_the_group_state_is_its_nodes_states() -> None:
    n0 = apply_status(
        apply_lines(RunState("n0"), run_lines(25), FIXED_NOW), Status(run_state=node_run_state(0))
    )
    n1 = apply_status(RunState("n1"), Status(run_state=node_run_state(1)))
    assert group_figures("pair", [n0, n1], FIXED_NOW).state == "running"
    # node 1's trainer recorded that its rank failed: the group failed there, named
    died = apply_status(
        n1,
        Status(
            state="crashed",
            exit_status=1,
            run_state=node_run_state(1, state="crashed", failed_rank=1),
        ),
    )
    peer = apply_status(n0, Status(state="crashed", exit_status=1))
    fig = group_figures("pair", [peer, died], FIXED_NOW)
    assert fig.state == "failed: n1 rank 1" and fig.view.failed is not None
    # unreachable beats nothing but a failure: one node lost, the other running, is degraded
    gone = replace(n1, run="unreachable", unreachable_since=FIXED_NOW - 120)
    assert group_figures("pair", [n0, gone], FIXED_NOW).state == "degraded: n1 unreachable"
    # a link that is down is unreachable too, whatever the last poll said
    retrying = replace(n1, link="retrying")
    assert group_figures("pair", [n0, retrying], FIXED_NOW).state == "degraded: n1 unreachable"
    # node 0 silent past the stale limit while running: the group's figures are stale
    assert group_figures("pair", [n0, n1], FIXED_NOW + 600).state == "stale"
    # not polled yet
    assert group_figures("pair", [RunState("n0"), RunState("n1")], FIXED_NOW).state == (
        "connecting"
    )
    mixed = replace(n1, release="0123456789ab")
    assert group_figures("pair", [n0, mixed], FIXED_NOW).release == "mixed"


async def test_nodes_run_state_files_reach_the_group_row_through_real_status(
    tmp_path: Path,
) -> None:
    """Each node's RUN/run-state.json (as the trainer's node 0 and node 1 write it: node_rank,
    nnodes, rank_range, step) read by a real RunControl over LocalTransport: the group row and
    the node rows show the steps, and node 1's host screen says which node it is."""
    import json
    import shutil
    import sys

    from dflashctl.config.inventory import local_host
    from dflashctl.remote import LocalTransport
    from dflashctl.runs.control import RunControl
    from tests.conftest import require_part

    require_part(shutil.which("tmux") is not None, "tmux not installed")
    (tmp_path / "tmux").mkdir()
    transport = LocalTransport(env={"TMUX_TMPDIR": str(tmp_path / "tmux")})
    hosts = []
    for rank, name in enumerate(("n0", "n1")):
        run = tmp_path / name / "run"
        run.mkdir(parents=True)
        doc = {"state": "stopped", "world_size": 2, "node_rank": rank, "nnodes": 2,
               "rank_range": [rank, rank + 1], "step": 40 + rank, "last_step": 40}  # fmt: skip
        (run / "run-state.json").write_text(json.dumps(doc))
        host = local_host(name, tmp_path / name, python=sys.executable, session=f"t-{name}")
        hosts.append(HostBinding(name, RunControl(transport, host)))
    app = DflashApp(hosts, groups={"pair": ("n0", "n1")})
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet", DataTable)
        await _until(pilot, lambda: _cell(table, "pair", "state") == "stopped")
        assert _cell(table, "pair", "step") == "40"  # node 0's
        await pilot.press("space")
        await _until(pilot, lambda: table.row_count == 3)
        assert [_cell(table, h, "step") for h in ("n0", "n1")] == ["40", "41"]
        await pilot.press("down", "down", "enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen))
        host_screen = app.screen
        assert isinstance(host_screen, HostScreen) and host_screen.host == "n1"
        await _until(pilot, lambda: "node 1 of 2, ranks 1-1" in _header(host_screen))
    await transport.close()


def test_a_supervised_groups_row_says_restarting_rendezvous_and_gave_up() -> None:
    """Every node's supervisor record reaches the group row: a node in its restart backoff is
    the group restarting after the rank that failed; nodes waiting for the others are the
    rendezvous with how many are there; a supervisor that gave up is the group's end, naming
    the rank; the group screen's header says the summary and the attempts."""
    from dflashctl.tui.screens.group import group_header

    n0 = apply_status(
        apply_lines(RunState("n0"), run_lines(25), FIXED_NOW), Status(run_state=node_run_state(0))
    )
    n1 = apply_status(RunState("n1"), Status(run_state=node_run_state(1)))
    killed = {"attempt": 1, "kind": "rank", "node_rank": 1, "rank": 1, "reason": "signal 9"}
    killed["at"] = "2026-12-01T10:00:00Z"
    sup = {"attempt": 1, "failures": [killed], "restarts": []}
    waiting = apply_status(n0, Status(state="rendezvous", supervisor={**sup, "failures": []}))
    backoff = apply_status(
        n1, Status(state="restarting", supervisor={**sup, "state": "restarting"})
    )
    fig = group_figures("pair", [waiting, backoff], FIXED_NOW)
    assert fig.state == "restarting: n1 rank 1"
    back = apply_status(n1, Status(state="rendezvous", supervisor=sup))
    alone = group_figures("pair", [waiting, apply_status(n1, Status(supervisor=sup))], FIXED_NOW)
    assert alone.state == "rendezvous (1/2 nodes)"
    assert group_figures("pair", [waiting, back], FIXED_NOW).state == "rendezvous (2/2 nodes)"
    gave = {**sup, "state": "gave-up", "detail": "gave up after 3 group restarts: ..."}
    ended = apply_status(n1, Status(state="gave-up", supervisor=gave))
    fig = group_figures("pair", [waiting, ended], FIXED_NOW)
    assert fig.state == "gave-up: n1 rank 1"
    header = group_header("pair", [waiting, ended], FIXED_NOW).plain
    assert "pair: gave-up: gave up after 3 group restarts: ...; attempt 1: node 1 (n1)" in header
    assert "attempt 1: node 1 (n1) rank 1: signal 9 -> not restarted" in header
