"""The service layer under the CLI, the TUI and the demo: typed host handles, the config watcher.

`open_inventory` and `open_local` return one `HostHandle` per host: its run control (a
`RunService`), its deploy, the argv that attaches to its tmux session, its local run config and
the run's shape as that config describes it. The TUI and the demo work on handles only; nothing
here imports Textual, and nothing here imports the CLI or the TUI (they import this, downward).

`ConfigWatcher` compares each host's local run config with the deployed one; its epoch counter
voids a comparison that a push or restart overtook.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from dflashctl.config.inventory import HostConfig, Inventory
from dflashctl.config.runconfig import read_config_text
from dflashctl.monitor.plan import RunShape, shape_from_config
from dflashctl.releases.deploy import DeployResult, Progress, deploy
from dflashctl.remote.commands import tmux_attach
from dflashctl.remote.connect import DEFAULT_TERM, TransportFactory, attach_argv, make_transport
from dflashctl.remote.transport import LocalTransport, Transport
from dflashctl.runs.control import RunControl
from dflashctl.runs.service import RestartResult, RunService


class DeployFn(Protocol):
    """Deploys the trainer release and the host's run config to one host (`dflashctl.releases.deploy`)."""

    def __call__(
        self, *, progress: Progress | None = None, fresh: bool = False
    ) -> Awaitable[DeployResult]: ...


DEPLOYED_REFRESH_S = 30.0
"""Re-read the deployed config this often: someone may push from the CLI meanwhile."""


@dataclass
class HostHandle:
    """What the CLI's long-lived views (the TUI, the demo) hold per host.

    `deploy`, `config_path` and `attach_argv` are optional: without them the TUI says the action
    is not available; without a shape the panes fall back to what the status lines alone show.
    `close` releases the host's transport when the view exits.
    """

    name: str
    control: RunService
    config_path: Path | None = None
    attach_argv: Sequence[str] | None = None
    deploy: DeployFn | None = None
    shape: RunShape = field(default_factory=RunShape)
    close: Callable[[], Awaitable[None]] | None = None


def _deploy_fn(transport: Transport, host: HostConfig) -> DeployFn:
    async def run(*, progress: Progress | None = None, fresh: bool = False) -> DeployResult:
        return await deploy(transport, host, config=host.run_config, progress=progress, fresh=fresh)

    return run


def open_host(
    host: HostConfig,
    transport: Transport,
    *,
    attach: Sequence[str] | None,
) -> HostHandle:
    """One handle over an opened transport: RunControl, deploy, the config's run shape."""
    return HostHandle(
        name=host.name,
        control=RunControl(transport, host),
        config_path=host.run_config,
        attach_argv=attach,
        deploy=_deploy_fn(transport, host),
        shape=shape_from_config(host.run_config) if host.run_config else RunShape(),
        close=transport.close,
    )


def open_inventory(
    inventory: Inventory,
    names: Sequence[str] = (),
    *,
    term: str | None = None,
    connect: TransportFactory = make_transport,
) -> list[HostHandle]:
    """One handle per named host (all hosts when `names` is empty), each on its own transport."""
    term = term or os.environ.get("TERM", DEFAULT_TERM)
    out = []
    for name in names or list(inventory.hosts):
        host = inventory.get(name)
        out.append(open_host(host, connect(host), attach=attach_argv(host, term)))
    return out


def open_local(host: HostConfig, *, label: str) -> HostHandle:
    """A handle on this machine (the demo): LocalTransport, attach is a local `tmux attach`."""
    return open_host(host, LocalTransport(label=label), attach=tmux_attach(host.session))


def restart_details(result: RestartResult) -> str:
    """`, checkpoint step N, release R` from a RestartResult (absent parts skipped)."""
    parts = []
    ckpt = result.stop.checkpoint
    if ckpt is not None:
        parts.append(f"checkpoint step {ckpt.step}")
    if result.start.release:
        parts.append(f"release {result.start.release}")
    return "".join(f", {p}" for p in parts)


def deploy_summary(host: str, result: DeployResult) -> str:
    """The one line a finished deploy is reported with (`kpro6: deployed release R`)."""
    return f"{host}: deployed" + (f" release {result.release}" if result.release else "")


# --- the config watcher ------------------------------------------------------------------------


@dataclass(frozen=True)
class ConfigVerdict:
    """One comparison of a host's local config with the deployed one.

    `changed`: they differ (the fleet shows "config changed"); `note` says why no comparison
    could be made; `reshaped`: the handle's shape was re-read from the local config.
    """

    changed: bool
    note: str | None = None
    reshaped: bool = False


class ConfigWatcher:
    """Local vs. deployed run config per host, without re-fetching the deployed copy each tick.

    `check` reads the local file when its mtime changed and the deployed copy at most every
    `refresh_s`; `forget` (after a push or restart) drops both caches and bumps the host's epoch,
    so a comparison started before it returns None instead of a stale verdict.
    """

    def __init__(
        self,
        *,
        refresh_s: float = DEPLOYED_REFRESH_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.refresh_s = refresh_s
        self.clock = clock
        self._seen: dict[str, tuple[float, str | None]] = {}
        self._deployed: dict[str, tuple[str, float]] = {}
        self._epoch: dict[str, int] = {}

    def epoch(self, host: str) -> int:
        return self._epoch.get(host, 0)

    def forget(self, host: str) -> None:
        """After a push or restart: drop cached comparisons, and void any check in flight."""
        self._epoch[host] = self.epoch(host) + 1
        self._deployed.pop(host, None)
        self._seen.pop(host, None)

    def edited(self, host: str) -> None:
        """The local file was just edited: compare it again at the next check."""
        self._seen.pop(host, None)

    async def check(self, handle: HostHandle) -> ConfigVerdict | None:
        """Compare now; None when there is nothing new to say (settled, or overtaken)."""
        name, path = handle.name, handle.config_path
        if path is None:
            return None
        epoch = self.epoch(name)
        try:
            mtime = path.stat().st_mtime
        except OSError as exc:
            return ConfigVerdict(False, f"{path}: {exc.strerror}")
        seen = self._seen.get(name)
        cached = self._deployed.get(name)
        now = self.clock()
        refetch = cached is None or now - cached[1] > self.refresh_s
        settled = seen is not None and seen[0] == mtime and not refetch
        if settled and handle.shape.boundaries is not None:
            return None
        try:
            local = read_config_text(path)
            if cached is None or refetch:
                deployed, fetched_at = await handle.control.deployed_config(), now
            else:
                deployed, fetched_at = cached
        except Exception as exc:  # unreachable host or unreadable file: say so, keep going
            return ConfigVerdict(False, f"{path}: {exc}")
        if self.epoch(name) != epoch:
            return None  # a push or restart happened meanwhile: this comparison is out of date
        if not deployed:
            return ConfigVerdict(False, f"{name}: deployed run/config.toml unreadable or absent")
        self._deployed[name] = (deployed, fetched_at)
        reshaped = seen is None or seen[0] != mtime or handle.shape.boundaries is None
        if reshaped:
            # the shape follows the config; "plan" edges appear once the store exists
            handle.shape = await asyncio.to_thread(shape_from_config, path)
        self._seen[name] = (mtime, local)
        return ConfigVerdict(local != deployed, reshaped=reshaped)
