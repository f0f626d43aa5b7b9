"""The dflashctl Textual app: fleet and host screens over live per-host followers.

Data path: one `HostFollower` task per host publishes immutable `RunState`s into `self.states`
and marks the host dirty; a single timer redraws the visible screen at `refresh_hz`, so 16 hosts
at 2 lines/s each cost a handful of redraws per second, not 32. Every service call (restart, stop,
deploy, config read) runs in a worker and reports through notifications, so a slow or dead host
never freezes the app.

The app is the Textual shell: it wires followers and timers to screens and keys to commands.
What it shows and what a key acts on is `targets`; what a host key does (its modal, its worker)
is `keys`; the run commands themselves are `commands` (Textual-free); what becomes a toast, and
its words, is `toasts`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.screen import ModalScreen, Screen
from textual.worker import Worker, WorkerState

from dflashctl.errors import ExitCode, UsageError
from dflashctl.fleet import ConfigWatcher, HostHandle, open_inventory
from dflashctl.monitor.follower import HostFollower
from dflashctl.monitor.plan import RunShape
from dflashctl.monitor.state import RunState, apply_lines
from dflashctl.tui import targets
from dflashctl.tui.keys import HostKeys
from dflashctl.tui.screens.fleet import FleetScreen
from dflashctl.tui.screens.group import GroupScreen
from dflashctl.tui.screens.help import QUIT_KEEPS_RUNS, HelpScreen
from dflashctl.tui.screens.host import HostScreen
from dflashctl.tui.targets import tui_groups, tui_hosts
from dflashctl.tui.toasts import Toast, news, worker_failure
from dflashctl.tui.view import LiveScreen

__all__ = ["DflashApp", "HostBinding", "parse_tui_args", "run_app", "tui_groups", "tui_hosts"]

CONFIG_CHECK_S = 2.0

HostBinding = HostHandle
"""The app's name for a host handle (`dflashctl.fleet.HostHandle`)."""


class DflashApp(App[None]):
    """`DflashApp(bindings)`; tests pass `live=False` and feed lines with `feed`."""

    TITLE = "dflashctl"
    CSS_PATH = "dflashctl.tcss"
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("r", "restart", "Restart", tooltip="Diff, verdict, then push + restart"),
        Binding("d", "deploy", "Deploy"),
        Binding("s", "stop", "Stop"),
        Binding("e", "edit", "Edit config"),
        Binding("a", "attach", "Attach"),
        Binding("l", "log", "Log"),
        Binding("c", "reconnect", "Reconnect"),
        Binding("question_mark", "help", "Help", key_display="?"),
        Binding("q", "quit", "Quit"),
    ]

    def __init__(
        self,
        hosts: Sequence[HostBinding],
        *,
        clock: Callable[[], float] = time.time,
        live: bool = True,
        refresh_hz: float = 4.0,
        editor: str | None = None,
        quit_action: str = QUIT_KEEPS_RUNS,
        groups: Mapping[str, Sequence[str]] | None = None,
    ) -> None:
        super().__init__()
        self.quit_action = quit_action  # what `q` does, as the help screen says it
        self.hosts: dict[str, HostHandle] = {h.name: h for h in hosts}
        self.groups: dict[str, tuple[str, ...]] = {
            name: tuple(nodes) for name, nodes in (groups or {}).items()
        }
        """Multi-node runs: group name -> node host names (node 0 first), each one of `hosts`."""
        for name, nodes in self.groups.items():
            missing = [n for n in nodes if n not in self.hosts]
            if missing or not nodes:
                raise ValueError(f"group {name!r}: nodes not among the hosts: {missing or nodes}")
        self.clock = clock
        self.live = live
        self.refresh_hz = refresh_hz
        self.editor = editor or os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
        self.states: dict[str, RunState] = {name: RunState(host=name) for name in self.hosts}
        self.followers: dict[str, HostFollower] = {}
        self.dirty: set[str] = set(self.hosts)
        self.frames = 0
        self.configs = ConfigWatcher()
        self.keys = HostKeys(self)

    # ------------------------------------------------------------------ lifecycle

    def on_mount(self) -> None:
        self.push_screen(FleetScreen())
        if self.live:
            for name, handle in self.hosts.items():
                follower = HostFollower(name, handle.control, self._publish, clock=self.clock)
                self.followers[name] = follower
                self.run_worker(follower.run(), name=name, group="follow", exit_on_error=False)
            self.set_interval(CONFIG_CHECK_S, self.check_configs)
            self.call_later(self.check_configs)
        self.set_interval(1.0 / self.refresh_hz, self.flush)
        self.call_later(self.flush)

    async def on_unmount(self) -> None:
        for handle in self.hosts.values():
            if handle.close is not None:
                with contextlib.suppress(Exception):
                    await handle.close()

    def _publish(self, state: RunState) -> None:
        old = self.states.get(state.host)
        self.states[state.host] = state
        self.dirty.add(state.host)
        if old is not None:  # each new supervisor event and Xid once, as a toast
            for toast in news(old, state):
                self.show_toast(toast)

    def show_toast(self, toast: Toast) -> None:
        """Show one of `toasts`' notifications."""
        self.notify(
            toast.message, title=toast.title, severity=toast.severity, timeout=toast.timeout
        )

    def feed(self, host: str, lines: Iterable[str], now: float | None = None) -> None:
        """Fold replayed status.log lines into a host's state (tests, benchmarks, replays)."""
        t = self.clock() if now is None else now
        self._publish(apply_lines(self.states[host], lines, t))

    def set_state(self, state: RunState) -> None:
        """Replace a host's state wholesale (tests and the demo's synthetic hosts)."""
        self._publish(state)

    def flush(self) -> None:
        """The coalesced redraw: one pass over the visible screen with everything that changed."""
        dirty, self.dirty = self.dirty, set()
        now = self.clock()
        for screen in reversed(self.screen_stack):
            if isinstance(screen, LiveScreen):
                try:
                    screen.refresh_view(self.states, now, dirty)
                except NoMatches:  # the screen is being torn down (app exiting): nothing to draw
                    return
            if not isinstance(screen, ModalScreen):
                break  # the screen under a modal stays live; anything deeper waits its turn
        self.frames += 1

    def shape_for(self, host: str) -> RunShape:
        return self.hosts[host].shape

    # ------------------------------------------------------------------ navigation

    def open_host(self, host: str) -> None:
        self.push_screen(HostScreen(host))
        self.dirty.add(host)
        self.call_later(self.flush)

    def open_group(self, group: str) -> None:
        self.push_screen(GroupScreen(group))
        self.dirty.update(self.groups[group])
        self.call_later(self.flush)

    def current_host(self) -> str | None:
        """The host the keys act on (`targets.current_host`)."""
        return targets.current_host(self.screen_stack)

    def current_group(self) -> str | None:
        """The group under the keys (`targets.current_group`)."""
        return targets.current_group(self.screen_stack)

    # ------------------------------------------------------------------ config watching

    async def check_configs(self) -> None:
        """Mark hosts whose local run config differs from the deployed one ("config changed")."""
        for name, handle in self.hosts.items():
            if handle.config_path is None or name not in self.followers:
                continue
            self.run_worker(
                self._check_config(handle), name=name, group="config", exit_on_error=False
            )

    async def _check_config(self, handle: HostHandle) -> None:
        verdict = await self.configs.check(handle)
        if verdict is None:
            return
        if verdict.reshaped:
            self.dirty.add(handle.name)
        self.followers[handle.name].mark_config(verdict.changed, verdict.note)

    # ------------------------------------------------------------------ actions (tui.keys)

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.quit_action))

    def action_log(self) -> None:
        self.keys.log()

    def action_reconnect(self) -> None:
        self.keys.reconnect()

    def action_restart(self) -> None:
        self.keys.restart()

    def action_stop(self) -> None:
        self.keys.stop()

    def action_deploy(self) -> None:
        self.keys.deploy()

    def action_edit(self) -> None:
        self.keys.edit()

    def action_attach(self) -> None:
        self.keys.attach()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """The one place a failed service call becomes a notification, titled by what failed."""
        worker = event.worker
        if event.state == WorkerState.ERROR:
            self.show_toast(worker_failure(worker.group, worker.name, worker.error))

    def get_system_commands(self, screen: Screen[Any]) -> Iterable[SystemCommand]:
        yield from super().get_system_commands(screen)
        yield SystemCommand(
            "Restart host", "Diff the config, then push + restart", self.action_restart
        )
        yield SystemCommand("Deploy host", "Deploy the trainer release", self.action_deploy)
        yield SystemCommand("Stop host", "Graceful stop (asks first)", self.action_stop)
        yield SystemCommand(
            "Edit run config", "Open the local run config in $EDITOR", self.action_edit
        )
        yield SystemCommand("Attach", "Attach to the tmux session", self.action_attach)
        yield SystemCommand("Full log", "Show the host's log", self.action_log)
        yield SystemCommand("Reconnect now", "Skip the backoff wait", self.action_reconnect)
        yield SystemCommand("Key map", "Show the keys", self.action_help)


def parse_tui_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflashctl tui", description="The live fleet TUI.")
    p.add_argument("--hosts", type=Path, default=None, help="inventory file (default hosts.toml)")
    p.add_argument("host", nargs="*", help="hosts to show (default: all in the inventory)")
    return p.parse_args(list(argv))


def run_app(argv: Sequence[str] | None = None) -> int:
    """`dflashctl [tui] [--hosts FILE] [HOST...]`: the app over the inventory's hosts.

    Errors (a bad inventory, none of its hosts) raise; `dflashctl.errors.run_main` reports them.
    """
    from dflashctl.config.inventory import load_inventory

    args = parse_tui_args(sys.argv[1:] if argv is None else argv)
    inventory = load_inventory(args.hosts)
    names = tui_hosts(inventory, args.host)
    hosts = open_inventory(inventory, names)
    if not hosts:
        raise UsageError("the inventory has no hosts")
    DflashApp(hosts, groups=tui_groups(inventory, names)).run()
    return ExitCode.OK
