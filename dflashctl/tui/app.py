"""The dflashctl Textual app: fleet and host screens over live per-host followers.

Data path: one `HostFollower` task per host publishes immutable `RunState`s into `self.states`
and marks the host dirty; a single timer redraws the visible screen at `refresh_hz`, so 16 hosts
at 2 lines/s each cost a handful of redraws per second, not 32. Every service call (restart, stop,
deploy, config read) runs in a worker and reports through notifications, so a slow or dead host
never freezes the app.

The app is the Textual shell: it wires followers and timers to screens and keys to commands.
What it shows and what a key acts on is `targets`; the run commands themselves are `commands`
(Textual-free); what becomes a toast, and its words, is `toasts`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shlex
import subprocess
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
from dflashctl.monitor.state import HostFollower, RestartPlan, RunShape, RunState, apply_lines
from dflashctl.tui import commands, targets
from dflashctl.tui.screens.confirm import ConfirmScreen
from dflashctl.tui.screens.fleet import FleetScreen
from dflashctl.tui.screens.group import GroupScreen
from dflashctl.tui.screens.help import QUIT_KEEPS_RUNS, HelpScreen
from dflashctl.tui.screens.host import HostScreen
from dflashctl.tui.screens.log import LogScreen
from dflashctl.tui.screens.restart import Report, RestartScreen
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

    # ------------------------------------------------------------------ actions

    def _need_host(self, verb: str | None = None) -> str | None:
        """The host a key acts on, or None after a warning saying why not (`targets.refusal`:
        a group's row, nothing highlighted, a run command `verb` on a node of a group)."""
        host = self.current_host()
        why = targets.refusal(host, self.current_group(), self.groups, verb)
        if why is not None:
            self.notify(why, severity="warning")
            return None
        return host

    def action_help(self) -> None:
        self.push_screen(HelpScreen(self.quit_action))

    def action_log(self) -> None:
        host = self._need_host()
        if host is not None:
            self.push_screen(LogScreen(host))
            self.dirty.add(host)

    def action_reconnect(self) -> None:
        host = self._need_host()
        if host is not None and host in self.followers:
            self.followers[host].reconnect_now()
            self.notify(f"{host}: reconnecting now")

    def action_restart(self) -> None:
        host = self._need_host("restart")
        if host is None:
            return
        state = self.states.get(host)
        if state is not None and state.measure is not None:  # start refuses it: say so first
            from dflashctl.runs.service import measure_refusal

            why = measure_refusal(state.measure, host, "a restart")
            self.notify(str(why), severity="warning")
            return
        self._open_restart(host)

    async def build_restart_plan(self, host: str) -> RestartPlan:
        """Deployed config (fresh from the host) vs. the local file, through the trainer's rules."""
        return await commands.build_restart_plan(self.hosts[host])

    def _open_restart(self, host: str) -> None:
        self.run_worker(
            self._restart_plan(host),
            name=host,
            group="restart-plan",
            exclusive=True,
            exit_on_error=False,
        )

    async def _restart_plan(self, host: str) -> None:
        plan = await self.build_restart_plan(host)
        self.push_screen(
            RestartScreen(host, plan, lambda report: self.do_restart(host, plan, report))
        )

    async def do_restart(self, host: str, plan: RestartPlan, report: Report) -> str:
        """`commands.restart_host`; returns (and says) the one-line result."""
        follower = self.followers.get(host)
        line = await commands.restart_host(self.hosts[host], plan, report, follower, self.configs)
        self.notify(line)
        return line

    def action_stop(self) -> None:
        host = self._need_host("stop")
        if host is None:
            return

        def confirmed(ok: bool | None) -> None:
            if ok:
                self.run_worker(self._stop(host), name=host, group="stop", exit_on_error=False)

        self.push_screen(
            ConfirmScreen(f"Stop the run on {host}? (graceful: checkpoint, then exit)", "Stop"),
            confirmed,
        )

    async def _stop(self, host: str) -> None:
        await commands.stop_host(self.hosts[host], self.followers.get(host), self.notify)

    def action_deploy(self) -> None:
        host = self._need_host("deploy")
        if host is not None:
            self.run_worker(self._deploy(host), name=host, group="deploy", exit_on_error=False)

    async def _deploy(self, host: str) -> None:
        await commands.deploy_host(self.hosts[host], self.followers.get(host), self.notify)

    def action_edit(self) -> None:
        host = self._need_host()
        if host is None:
            return
        path = self.hosts[host].config_path
        if path is None:
            self.notify(f"{host}: no run_config in the inventory", severity="warning")
            return
        self._suspend_and_run([*shlex.split(self.editor), str(path)])
        self.configs.edited(host)
        self.call_later(self.check_configs)

    def action_attach(self) -> None:
        host = self._need_host()
        if host is None:
            return
        argv = self.hosts[host].attach_argv
        if not argv:
            self.notify(f"{host}: attach is not available", severity="warning")
            return
        self._suspend_and_run(list(argv))

    def _suspend_and_run(self, argv: list[str]) -> None:
        try:
            with self.suspend():
                subprocess.call(argv)
        except Exception as exc:  # SuspendNotSupported (headless) or the program is missing
            self.notify(f"cannot run {argv[0]}: {exc}", severity="error")

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
