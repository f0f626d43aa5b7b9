"""The run commands the TUI's keys start (restart, stop, deploy), without Textual.

Each is one host's service calls in order (`HostHandle.control`, `HostHandle.deploy`), then the
follower brought up to date so the screen shows the outcome without waiting for its next poll;
what they have to say goes through `say` (the app's `notify`). The app decides when to run them
(in a worker, after a modal) and routes a raised error (`toasts.worker_failure`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Literal, Protocol

from dflashctl.fleet import ConfigWatcher, HostHandle, deploy_summary, restart_details
from dflashctl.monitor.follower import HostFollower
from dflashctl.monitor.restart_plan import RestartPlan, plan_restart

__all__ = [
    "STOP_TIMEOUT_S",
    "Say",
    "build_restart_plan",
    "deploy_host",
    "restart_host",
    "stop_host",
]

STOP_TIMEOUT_S = 120.0
"""How long a graceful stop may wait for the trainer's checkpoint."""


class Say(Protocol):
    """Where a command's progress and outcome go (`App.notify` satisfies it)."""

    def __call__(
        self, message: str, *, severity: Literal["information", "warning", "error"] = ...
    ) -> None: ...


async def build_restart_plan(handle: HostHandle) -> RestartPlan:
    """Deployed config (fresh from the host) vs. the local file, through the trainer's rules."""
    if handle.config_path is None:
        return RestartPlan(
            diff="", fresh=False, error=f"{handle.name}: no run_config in the inventory"
        )
    deployed = await handle.control.deployed_config()
    checkpoint = await handle.control.checkpoint_config()
    return await asyncio.to_thread(plan_restart, deployed, handle.config_path, checkpoint)


async def restart_host(
    handle: HostHandle,
    plan: RestartPlan,
    report: Callable[[str], None],
    follower: HostFollower | None,
    configs: ConfigWatcher,
) -> str:
    """Push the local config, deploy if needed, stop gracefully, start (fresh when the plan
    says so) via `RunControl.restart`; returns the one-line result."""
    host = handle.name
    report(
        "stopping gracefully, pushing the config, starting ..."
        if plan.changed
        else "restarting ..."
    )
    result = await handle.control.restart(
        fresh=plan.fresh, config=handle.config_path, progress=report
    )
    configs.forget(host)
    if follower is not None:
        if plan.fresh:
            follower.new_run()
        follower.mark_config(False)
        await follower.poll_status()
        follower.reconnect_now()
    return f"{host}: restarted ({'fresh' if plan.fresh else 'resume'})" + restart_details(result)


async def stop_host(handle: HostHandle, follower: HostFollower | None, say: Say) -> None:
    """A graceful stop (checkpoint, then exit), said before and after."""
    say(f"{handle.name}: stopping (waiting for the checkpoint) ...")
    await handle.control.stop(timeout=STOP_TIMEOUT_S)
    if follower is not None:
        await follower.poll_status()
    say(f"{handle.name}: stopped")


async def deploy_host(handle: HostHandle, follower: HostFollower | None, say: Say) -> None:
    """Deploy the trainer release (where the handle can) and say what it did."""
    deploy = handle.deploy
    if deploy is None:
        say(f"{handle.name}: deploy is not available here", severity="warning")
        return
    say(f"{handle.name}: deploying ...")
    say(deploy_summary(handle.name, await deploy()))
    if follower is not None:
        await follower.poll_status()
