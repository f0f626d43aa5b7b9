"""What the host keys do (r restart, s stop, d deploy, e edit, a attach, l log, c reconnect).

`HostKeys` is the app's key handling for the highlighted host: which host a key acts on (or
why it refuses), the modal it opens, and the worker that runs the Textual-free command
(`tui.commands`). The app binds the keys and calls these; its own job is the screens, the
followers and the redraw.
"""

from __future__ import annotations

import shlex
import subprocess
from typing import TYPE_CHECKING

from dflashctl.monitor.restart_plan import RestartPlan
from dflashctl.tui import commands, targets
from dflashctl.tui.screens.confirm import ConfirmScreen
from dflashctl.tui.screens.log import LogScreen
from dflashctl.tui.screens.restart import Report, RestartScreen

if TYPE_CHECKING:
    from dflashctl.tui.app import DflashApp


class HostKeys:
    """The host-acting keys of one `DflashApp`."""

    def __init__(self, app: DflashApp) -> None:
        self.app = app

    def need_host(self, verb: str | None = None) -> str | None:
        """The host a key acts on, or None after a warning saying why not (`targets.refusal`:
        a group's row, nothing highlighted, a run command `verb` on a node of a group)."""
        host = self.app.current_host()
        why = targets.refusal(host, self.app.current_group(), self.app.groups, verb)
        if why is not None:
            self.app.notify(why, severity="warning")
            return None
        return host

    def log(self) -> None:
        host = self.need_host()
        if host is not None:
            self.app.push_screen(LogScreen(host))
            self.app.dirty.add(host)

    def reconnect(self) -> None:
        host = self.need_host()
        if host is not None and host in self.app.followers:
            self.app.followers[host].reconnect_now()
            self.app.notify(f"{host}: reconnecting now")

    def restart(self) -> None:
        host = self.need_host("restart")
        if host is None:
            return
        state = self.app.states.get(host)
        if state is not None and state.measure is not None:  # start refuses it: say so first
            from dflashctl.runs.service import measure_refusal

            why = measure_refusal(state.measure, host, "a restart")
            self.app.notify(str(why), severity="warning")
            return
        self._open_restart(host)

    async def build_restart_plan(self, host: str) -> RestartPlan:
        """Deployed config (fresh from the host) vs. the local file, through the trainer's rules."""
        return await commands.build_restart_plan(self.app.hosts[host])

    def _open_restart(self, host: str) -> None:
        self.app.run_worker(
            self._restart_plan(host),
            name=host,
            group="restart-plan",
            exclusive=True,
            exit_on_error=False,
        )

    async def _restart_plan(self, host: str) -> None:
        plan = await self.build_restart_plan(host)
        self.app.push_screen(
            RestartScreen(host, plan, lambda report: self.do_restart(host, plan, report))
        )

    async def do_restart(self, host: str, plan: RestartPlan, report: Report) -> str:
        """`commands.restart_host`; returns (and says) the one-line result."""
        follower = self.app.followers.get(host)
        line = await commands.restart_host(
            self.app.hosts[host], plan, report, follower, self.app.configs
        )
        self.app.notify(line)
        return line

    def stop(self) -> None:
        host = self.need_host("stop")
        if host is None:
            return

        def confirmed(ok: bool | None) -> None:
            if ok:
                self.app.run_worker(
                    self._stop_host(host), name=host, group="stop", exit_on_error=False
                )

        self.app.push_screen(
            ConfirmScreen(f"Stop the run on {host}? (graceful: checkpoint, then exit)", "Stop"),
            confirmed,
        )

    async def _stop_host(self, host: str) -> None:
        await commands.stop_host(
            self.app.hosts[host], self.app.followers.get(host), self.app.notify
        )

    def deploy(self) -> None:
        host = self.need_host("deploy")
        if host is not None:
            self.app.run_worker(
                self._deploy_host(host), name=host, group="deploy", exit_on_error=False
            )

    async def _deploy_host(self, host: str) -> None:
        await commands.deploy_host(
            self.app.hosts[host], self.app.followers.get(host), self.app.notify
        )

    def edit(self) -> None:
        host = self.need_host()
        if host is None:
            return
        path = self.app.hosts[host].config_path
        if path is None:
            self.app.notify(f"{host}: no run_config in the inventory", severity="warning")
            return
        self.suspend_and_run([*shlex.split(self.app.editor), str(path)])
        self.app.configs.edited(host)
        self.app.call_later(self.app.check_configs)

    def attach(self) -> None:
        host = self.need_host()
        if host is None:
            return
        argv = self.app.hosts[host].attach_argv
        if not argv:
            self.app.notify(f"{host}: attach is not available", severity="warning")
            return
        self.suspend_and_run(list(argv))

    def suspend_and_run(self, argv: list[str]) -> None:
        try:
            with self.app.suspend():
                subprocess.call(argv)
        except Exception as exc:  # SuspendNotSupported (headless) or the program is missing
            self.app.notify(f"cannot run {argv[0]}: {exc}", severity="error")
