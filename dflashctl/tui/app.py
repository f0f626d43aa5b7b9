"""The dflashctl Textual app: fleet and host screens over live per-host followers.

Data path: one `HostFollower` task per host publishes immutable `RunState`s into `self.states`
and marks the host dirty; a single timer redraws the visible screen at `refresh_hz`, so 16 hosts
at 2 lines/s each cost a handful of redraws per second, not 32. Every service call (restart, stop,
deploy, config read) runs in a worker and reports through notifications, so a slow or dead host
never freezes the app.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import subprocess
import sys
import time
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from textual import work
from textual.app import App, SystemCommand
from textual.binding import Binding, BindingType
from textual.css.query import NoMatches
from textual.screen import ModalScreen, Screen

from dflashctl.monitor import (
    HostFollower,
    RestartPlan,
    RunShape,
    RunState,
    apply_lines,
    plan_restart,
    shape_from_config,
    supervisor_events,
)
from dflashctl.runconfig import read_config_text
from dflashctl.tui.screens.confirm import ConfirmScreen
from dflashctl.tui.screens.fleet import FleetScreen
from dflashctl.tui.screens.help import QUIT_KEEPS_RUNS, HelpScreen
from dflashctl.tui.screens.host import HostScreen
from dflashctl.tui.screens.log import LogScreen
from dflashctl.tui.screens.restart import Report, RestartScreen

CONFIG_CHECK_S = 2.0
DEPLOYED_REFRESH_S = 30.0
"""Re-read the deployed config this often: someone may push from the CLI meanwhile."""
STOP_TIMEOUT_S = 120.0


@dataclass
class HostBinding:
    """What the app needs per host: the run control service and the local side of the host.

    `control` is a `dflashctl.control.RunControl` (status, follow, gpus, start, stop, restart,
    push_config, deployed_config). `deploy` and `shape` are optional: without `deploy` the `d` key
    says so; without a shape the panes fall back to what the status lines alone show.
    """

    name: str
    control: Any
    config_path: Path | None = None
    attach_argv: Sequence[str] | None = None
    deploy: Callable[[], Awaitable[Any]] | None = None
    shape: RunShape = field(default_factory=RunShape)
    close: Callable[[], Awaitable[None]] | None = None
    """Closes the host's transport when the app exits."""


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
    ) -> None:
        super().__init__()
        self.quit_action = quit_action  # what `q` does, as the help screen says it
        self.hosts: dict[str, HostBinding] = {h.name: h for h in hosts}
        self.clock = clock
        self.live = live
        self.refresh_hz = refresh_hz
        self.editor = editor or os.environ.get("VISUAL") or os.environ.get("EDITOR") or "vi"
        self.states: dict[str, RunState] = {name: RunState(host=name) for name in self.hosts}
        self.followers: dict[str, HostFollower] = {}
        self.dirty: set[str] = set(self.hosts)
        self.frames = 0
        self._config_seen: dict[str, tuple[float, str | None]] = {}
        self._deployed_cache: dict[str, tuple[str, float]] = {}
        self._config_epoch: dict[str, int] = {}

    # ------------------------------------------------------------------ lifecycle

    def on_mount(self) -> None:
        self.push_screen(FleetScreen())
        if self.live:
            for name, binding in self.hosts.items():
                follower = HostFollower(name, binding.control, self._publish, clock=self.clock)
                self.followers[name] = follower
                self.run_worker(follower.run(), group=f"follow:{name}", exit_on_error=False)
            self.set_interval(CONFIG_CHECK_S, self.check_configs)
            self.call_later(self.check_configs)
        self.set_interval(1.0 / self.refresh_hz, self.flush)
        self.call_later(self.flush)

    async def on_unmount(self) -> None:
        for binding in self.hosts.values():
            if binding.close is not None:
                with contextlib.suppress(Exception):
                    await binding.close()

    def _publish(self, state: RunState) -> None:
        old = self.states.get(state.host)
        self.states[state.host] = state
        self.dirty.add(state.host)
        if old is not None:  # each new supervisor event once, as a toast
            for severity, text in supervisor_events(old, state):
                self.notify(text, severity=severity, timeout=30)  # type: ignore[arg-type]

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
            refresh = getattr(screen, "refresh_view", None)
            if refresh is not None:
                try:
                    refresh(self.states, now, dirty)
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

    def current_host(self) -> str | None:
        """The host the keys act on: the host screen's, or the fleet's highlighted row."""
        for screen in reversed(self.screen_stack):
            host = getattr(screen, "host", None)
            if isinstance(host, str):
                return host
            if isinstance(screen, FleetScreen):
                return screen.selected_host()
        return None

    # ------------------------------------------------------------------ config watching

    async def check_configs(self) -> None:
        """Mark hosts whose local run config differs from the deployed one ("config changed")."""
        for name, binding in self.hosts.items():
            if binding.config_path is None or name not in self.followers:
                continue
            self._check_config(name, binding)

    @work(exit_on_error=False, group="config")
    async def _check_config(self, name: str, binding: HostBinding) -> None:
        path = binding.config_path
        assert path is not None
        follower = self.followers[name]
        epoch = self._config_epoch.get(name, 0)
        try:
            mtime = path.stat().st_mtime
        except OSError as exc:
            follower.mark_config(False, f"{path}: {exc.strerror}")
            return
        seen = self._config_seen.get(name)
        cached = self._deployed_cache.get(name)
        now = time.monotonic()
        refetch = cached is None or now - cached[1] > DEPLOYED_REFRESH_S
        settled = seen is not None and seen[0] == mtime and not refetch
        if settled and binding.shape.boundaries is not None:
            return
        try:
            local = read_config_text(path)
            deployed = await binding.control.deployed_config() if refetch else cached[0]  # type: ignore[index]
        except Exception as exc:  # unreachable host or unreadable file: say so, keep going
            follower.mark_config(False, f"{path}: {exc}")
            return
        if self._config_epoch.get(name, 0) != epoch:
            return  # a push or restart happened meanwhile: this comparison is out of date
        if not deployed:
            follower.mark_config(False, f"{name}: deployed run/config.toml unreadable or absent")
            return
        self._deployed_cache[name] = (deployed, now if refetch else cached[1])  # type: ignore[index]
        if seen is None or seen[0] != mtime or binding.shape.boundaries is None:
            # the shape follows the config; "plan" edges appear once the store exists
            binding.shape = await asyncio.to_thread(shape_from_config, path)
            self.dirty.add(name)
        self._config_seen[name] = (mtime, local)
        follower.mark_config(local != deployed)

    def _forget_config(self, host: str) -> None:
        """After a push or restart: drop cached comparisons, and void any check in flight."""
        self._config_epoch[host] = self._config_epoch.get(host, 0) + 1
        self._deployed_cache.pop(host, None)
        self._config_seen.pop(host, None)

    # ------------------------------------------------------------------ actions

    def _need_host(self) -> str | None:
        host = self.current_host()
        if host is None:
            self.notify("no host selected", severity="warning")
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
        host = self._need_host()
        if host is not None:
            self._open_restart(host)

    async def build_restart_plan(self, host: str) -> RestartPlan:
        """Deployed config (fresh from the host) vs. the local file, through the trainer's rules."""
        binding = self.hosts[host]
        if binding.config_path is None:
            return RestartPlan(
                diff="", fresh=False, error=f"{host}: no run_config in the inventory"
            )
        deployed = await binding.control.deployed_config()
        read_checkpoint = getattr(binding.control, "checkpoint_config", None)
        if read_checkpoint is None:  # a control that cannot read checkpoints
            return await asyncio.to_thread(plan_restart, deployed, binding.config_path)
        checkpoint = await read_checkpoint()
        return await asyncio.to_thread(plan_restart, deployed, binding.config_path, checkpoint)

    @work(exclusive=True, exit_on_error=False, group="restart-plan")
    async def _open_restart(self, host: str) -> None:
        try:
            plan = await self.build_restart_plan(host)
        except Exception as exc:
            self.notify(f"{host}: cannot read the deployed config: {exc}", severity="error")
            return
        self.push_screen(
            RestartScreen(host, plan, lambda report: self.do_restart(host, plan, report))
        )

    async def do_restart(self, host: str, plan: RestartPlan, report: Report) -> str:
        """Push the local config, deploy if needed, stop gracefully, start (fresh when the plan
        says so) via `RunControl.restart`; returns the one-line result."""
        binding = self.hosts[host]
        report(
            "stopping gracefully, pushing the config, starting ..."
            if plan.changed
            else "restarting ..."
        )
        result = await binding.control.restart(
            fresh=plan.fresh, config=binding.config_path, progress=report
        )
        self._forget_config(host)
        follower = self.followers.get(host)
        if follower is not None:
            if plan.fresh:
                follower.new_run()
            follower.mark_config(False)
            await follower.poll_status()
            follower.reconnect_now()
        line = f"{host}: restarted ({'fresh' if plan.fresh else 'resume'})" + restart_details(
            result
        )
        self.notify(line)
        return line

    def action_stop(self) -> None:
        host = self._need_host()
        if host is None:
            return

        def confirmed(ok: bool | None) -> None:
            if ok:
                self._stop(host)

        self.push_screen(
            ConfirmScreen(f"Stop the run on {host}? (graceful: checkpoint, then exit)", "Stop"),
            confirmed,
        )

    @work(exit_on_error=False, group="stop")
    async def _stop(self, host: str) -> None:
        self.notify(f"{host}: stopping (waiting for the checkpoint) ...")
        try:
            await self.hosts[host].control.stop(timeout=STOP_TIMEOUT_S)
        except Exception as exc:
            self.notify(f"{host}: stop failed: {exc}", severity="error")
            return
        if host in self.followers:
            await self.followers[host].poll_status()
        self.notify(f"{host}: stopped")

    def action_deploy(self) -> None:
        host = self._need_host()
        if host is not None:
            self._deploy(host)

    @work(exit_on_error=False, group="deploy")
    async def _deploy(self, host: str) -> None:
        deploy = self.hosts[host].deploy
        if deploy is None:
            self.notify(f"{host}: deploy is not available here", severity="warning")
            return
        self.notify(f"{host}: deploying ...")
        try:
            result = await deploy()
        except Exception as exc:
            self.notify(f"{host}: deploy failed: {exc}", severity="error")
            return
        release = getattr(result, "release", None) or getattr(result, "release_hash", None)
        self.notify(f"{host}: deployed" + (f" release {release}" if release else ""))
        if host in self.followers:
            await self.followers[host].poll_status()

    def action_edit(self) -> None:
        host = self._need_host()
        if host is None:
            return
        path = self.hosts[host].config_path
        if path is None:
            self.notify(f"{host}: no run_config in the inventory", severity="warning")
            return
        self._suspend_and_run([*shlex.split(self.editor), str(path)])
        self._config_seen.pop(host, None)
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


def restart_details(result: Any) -> str:
    """`, checkpoint step N, release R` from a RestartResult (read by name; absent parts skipped)."""
    parts = []
    ckpt = getattr(getattr(result, "stop", None), "checkpoint", None)
    if ckpt is not None:
        parts.append(f"checkpoint step {ckpt.step}")
    release = getattr(getattr(result, "start", None), "release", None)
    if release:
        parts.append(f"release {release}")
    return "".join(f", {p}" for p in parts)


def parse_tui_args(argv: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="dflashctl tui", description="The live fleet TUI.")
    p.add_argument("--hosts", type=Path, default=None, help="inventory file (default hosts.toml)")
    p.add_argument("host", nargs="*", help="hosts to show (default: all in the inventory)")
    return p.parse_args(list(argv))


def bindings_from_inventory(inventory: Any, names: Sequence[str]) -> list[HostBinding]:
    """One binding per inventory host: SSH transport, RunControl, local config, attach argv."""
    from dflashctl.cli import attach_argv, make_transport
    from dflashctl.control import RunControl
    from dflashctl.deploy import deploy

    out = []
    for name in names or list(inventory.hosts):
        host = inventory.get(name)
        transport = make_transport(host)

        async def do_deploy(t: Any = transport, h: Any = host) -> Any:
            return await deploy(t, h, config=h.run_config)

        out.append(
            HostBinding(
                name=host.name,
                control=RunControl(transport, host),
                config_path=host.run_config,
                attach_argv=attach_argv(host, os.environ.get("TERM", "xterm-256color")),
                deploy=do_deploy,
                shape=shape_from_config(host.run_config) if host.run_config else RunShape(),
                close=transport.close,
            )
        )
    return out


def run_app(argv: Sequence[str] | None = None) -> int:
    """`dflashctl [tui] [--hosts FILE] [HOST...]`: the app over the inventory's hosts."""
    from dflashctl.inventory import InventoryError, load_inventory

    args = parse_tui_args(sys.argv[1:] if argv is None else argv)
    try:
        hosts = bindings_from_inventory(load_inventory(args.hosts), args.host)
    except InventoryError as exc:
        print(f"dflashctl: {exc}", file=sys.stderr)
        return 2
    if not hosts:
        print("dflashctl: the inventory has no hosts", file=sys.stderr)
        return 2
    DflashApp(hosts).run()
    return 0
