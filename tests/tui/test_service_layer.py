"""The Textual-free service layer under the TUI (dflashctl.fleet): handles, config watcher."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from dflashctl.config.inventory import HostConfig, parse_inventory
from dflashctl.fleet import ConfigWatcher, HostHandle, open_inventory, restart_details
from dflashctl.remote.transport import LocalTransport, Transport
from dflashctl.runs.control import RunControl
from dflashctl.runs.service import RestartResult, StartResult, StopResult
from dflashctl.tui.app import DflashApp
from dflashctl.tui.view import AppView
from tests.tui.fixtures import ReplayControl, deploy_result, service
from trainer.events import CheckpointEvent

INVENTORY = """\
[hosts.kpro6]
address = "192.0.2.6"
ctid = 206
session = "dflash-a"

[hosts.kpro7]
address = "192.0.2.7"
ctid = 207
"""


def test_open_inventory_gives_each_host_its_control_attach_and_transport(tmp_path: Path) -> None:
    inv = parse_inventory(INVENTORY, tmp_path / "hosts.toml")
    opened: list[str] = []

    def connect(host: HostConfig) -> Transport:
        opened.append(host.name)
        return LocalTransport(label=host.name)

    handles = open_inventory(inv, ["kpro6"], term="xterm-256color", connect=connect)
    assert [h.name for h in handles] == ["kpro6"] and opened == ["kpro6"]
    (h,) = handles
    assert isinstance(h.control, RunControl) and h.close is not None and h.deploy is not None
    assert h.attach_argv is not None and h.attach_argv[0] == "ssh"
    assert "root@192.0.2.6" in h.attach_argv and "dflash-a" in h.attach_argv[-1]
    assert [h.name for h in open_inventory(inv, connect=connect)] == ["kpro6", "kpro7"]


def test_restart_details_names_the_checkpoint_and_the_release() -> None:
    start = StartResult("h", True, "3f9a1c2b7d10", 42, ["python", "-m", "trainer"])
    path = "run/checkpoints/step-00001200.pt"
    ck = CheckpointEvent(step=1200, path=path, text=f"Checkpoint saved: step=1200 path={path}")
    stop = StopResult("h", True, ck, "checkpointed")
    result = RestartResult("h", deploy_result("3f9a1c2b7d10"), stop, start, "", None, None)
    assert restart_details(result) == ", checkpoint step 1200, release 3f9a1c2b7d10"
    bare = RestartResult(
        "h", deploy_result(""), StopResult("h", False, None, "not-running"), start, "", None, None
    )
    assert restart_details(bare) == ", release 3f9a1c2b7d10"


def _watched(tmp_path: Path, local: str, deployed: str) -> tuple[HostHandle, ReplayControl]:
    path = tmp_path / "run.toml"
    path.write_text(local)
    control = ReplayControl(deployed=deployed)
    return HostHandle("kpro6", service(control), config_path=path), control


async def test_config_watcher_compares_and_settles(tmp_path: Path) -> None:
    handle, control = _watched(tmp_path, "[status]\ninterval_s = 5\n", "[status]\ninterval_s = 1\n")
    watcher = ConfigWatcher()
    verdict = await watcher.check(handle)
    assert verdict is not None and verdict.changed and verdict.note is None and verdict.reshaped
    fetches = [c for c in control.calls if c[0] == "deployed_config"]
    assert len(fetches) == 1
    await watcher.check(handle)  # the local file did not change, the deployed copy is fresh
    assert [c for c in control.calls if c[0] == "deployed_config"] == fetches
    watcher.forget(handle.name)  # a push: compare again from scratch
    control.deployed = "[status]\ninterval_s = 5\n"
    again = await watcher.check(handle)
    assert again is not None and not again.changed


async def test_config_watcher_voids_a_check_a_push_overtook(tmp_path: Path) -> None:
    handle, control = _watched(tmp_path, "a = 1\n", "a = 2\n")
    watcher = ConfigWatcher()
    gate = asyncio.Event()
    inner = control.deployed_config

    async def slow_fetch() -> str:
        await gate.wait()
        return await inner()

    control.deployed_config = slow_fetch  # type: ignore[method-assign]  # hold the fetch open
    pending = asyncio.create_task(watcher.check(handle))
    await asyncio.sleep(0)
    watcher.forget(handle.name)  # a restart pushed the config meanwhile
    gate.set()
    assert await pending is None


async def test_config_watcher_says_why_it_cannot_compare(tmp_path: Path) -> None:
    handle, _ = _watched(tmp_path, "a = 1\n", "")
    watcher = ConfigWatcher()
    absent = await watcher.check(handle)
    assert absent is not None and not absent.changed
    assert absent.note == "kpro6: deployed run/config.toml unreadable or absent"
    assert handle.config_path is not None
    os.unlink(handle.config_path)
    gone = await watcher.check(handle)
    assert gone is not None and gone.note == f"{handle.config_path}: No such file or directory"


def test_the_app_is_what_its_screens_see() -> None:
    app = DflashApp([HostHandle("h", service())], live=False)
    view: AppView = app  # checked statically: the screens' Protocol matches the app
    assert isinstance(view, AppView) and list(view.hosts) == ["h"]
