"""`start HOST` launches torchrun when the deployed run config needs several ranks.

The argv builder alone (one rank: today's argv byte for byte; eight: torchrun --standalone
around the same trainer arguments), and the real thing through LocalTransport: the committed
trainer deployed with the tiny CPU config on two CPU drafter devices -> `start` runs the
supervisor, torchrun under it, two gloo ranks -> run-state.json says world size 2 and the steps
advance -> `stop` (one C-c: the supervisor forwards it to torchrun, torchrun once to each rank)
leaves a checkpoint and a stopped run, with no rank left behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from dflashctl.config.inventory import local_host
from dflashctl.config.runconfig import drafter_device_count
from dflashctl.errors import UsageError
from dflashctl.releases.deploy import deploy
from dflashctl.releases.release import build_release
from dflashctl.remote import LocalTransport
from dflashctl.remote.commands import SUPERVISOR_MODULE
from dflashctl.remote.run import TORCHRUN_MODULE, host_trainer_argv, trainer_argv
from dflashctl.runs.control import RunControl
from dflashctl.runs.starter import TORCHRUN_SHUTDOWN_TIMEOUT_S
from tests import budget
from tests.conftest import require_part
from tests.ctl import parts as P
from trainer.config.overlay import dump_toml, merge

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"


# --- the argv builder ------------------------------------------------------------------------


@pytest.mark.parametrize(("fresh", "resume"), [(False, "auto"), (True, "auto"), (False, "12")])
def test_one_rank_keeps_the_plain_trainer_argv(fresh: bool, resume: str) -> None:
    assert host_trainer_argv("/py", fresh, resume) == trainer_argv("/py", fresh, resume)
    assert host_trainer_argv("/py", fresh, resume, 1) == trainer_argv("/py", fresh, resume)


def test_eight_ranks_run_the_same_trainer_args_under_standalone_torchrun() -> None:
    got = host_trainer_argv("/venv/bin/python", False, "auto", 8)
    assert got == [
        "/venv/bin/python",
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "8",
        "--max-restarts",
        "0",
        "-m",
        "trainer",
        "--config",
        "run/config.toml",
        "--run-dir",
        "run",
        "--resume",
        "auto",
    ]
    assert got[8:] == trainer_argv("/venv/bin/python", False)[1:]
    fresh = host_trainer_argv("/p", True, nproc=2)
    assert fresh[-1] == "--fresh" and fresh[:3] == ["/p", "-m", TORCHRUN_MODULE]


@pytest.mark.parametrize("bad", [0, -1, True])
def test_a_rank_count_below_one_is_refused(bad: int) -> None:
    with pytest.raises(UsageError, match="rank count"):
        host_trainer_argv("/p", False, nproc=bad)


def test_the_8_rank_config_gets_8_ranks() -> None:
    cfg = REPO / "configs" / "qwen3-8b-2x6.toml"
    require_part(cfg.is_file(), "configs/qwen3-8b-2x6.toml not in this checkout")
    n = drafter_device_count(cfg.read_text())
    assert n == 8
    assert host_trainer_argv("py", False, nproc=n)[5] == "8"


# --- the real run through LocalTransport -----------------------------------------------------


def two_rank_config(assets: Path) -> str:
    """The tiny config on two CPU drafter devices; assets at absolute paths; a run that outlasts
    the test; checkpoints only at the stop."""
    raw = tomllib.loads(TINY.read_text())
    return dump_toml(
        merge(
            raw,
            {
                "data": {"store": str(assets / "store")},
                "model": {"target_dir": str(assets / "target")},
                "topology": {"drafter_devices": ["cpu", "cpu"]},
                "schedule": {"epochs": 50},
                "status": {"interval_s": 1, "rate_window_s": 5},
                "checkpoint": {"every_steps": 100000, "every_minutes": 600.0, "keep_last": 3},
            },
        )
    )


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[RunControl]:
    require_part(shutil.which("tmux") is not None, "tmux not installed")
    require_part(TINY.is_file(), "configs/tiny-cpu.toml not in this checkout")
    sock = tmp_path / "tmux"
    sock.mkdir()
    transport = LocalTransport(env={"TMUX_TMPDIR": str(sock)})
    host = local_host("loc", tmp_path / "wd", python=sys.executable, session="t")
    host = host.model_copy(update={"env": {"OMP_NUM_THREADS": "1"}})
    yield RunControl(transport, host)
    await transport.run(["tmux", "-L", "dflash", "kill-server"])
    await transport.close()


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_two_cpu_drafter_ranks_start_step_and_stop_under_torchrun(
    ctl: RunControl, tmp_path: Path
) -> None:
    tree = P.frozen_tree(tmp_path / "tree")
    cfg = tmp_path / "run.toml"
    cfg.write_text(two_rank_config(tmp_path / "assets"))
    assert drafter_device_count(cfg.read_text()) == 2
    await asyncio.to_thread(P.build_tiny_assets, cfg, tree)
    rel = build_release(tree)
    await deploy(
        ctl.transport, ctl.host, release=rel, config=cfg, min_free_bytes=0, import_check=False
    )

    started = await ctl.start(wait_s=budget.left())
    assert started.started and started.ready, started
    argv = started.argv
    assert argv[:3] == [sys.executable, "-m", SUPERVISOR_MODULE], argv
    at = argv.index("--") + 1
    assert argv[at:] == host_trainer_argv(sys.executable, False, "auto", 2)

    run = Path(ctl.host.run_dir)
    first: int | None = None
    state: dict[str, Any] = {}

    async def two_steps_on_2_ranks() -> bool:
        nonlocal first, state
        st = await ctl.status()
        assert st.state == "running", (st.state, st.last_error, st.pane_tail)
        state = json.loads((run / "run-state.json").read_text())
        step = st.step  # the status lines' step (run-state.json is not rewritten per step)
        if state.get("world_size") == 2 and step is not None:
            first = step if first is None else first
            return step >= first + 2
        return False

    await budget.until_awaited(two_steps_on_2_ranks, every=0.5, detail=lambda: str(state))
    assert first is not None
    rank0 = state["pid"]
    assert isinstance(rank0, int) and alive(rank0)
    # torchrun's grace before it SIGKILLs the ranks after a stop: raised for the checkpoint
    environ = Path(f"/proc/{rank0}/environ").read_bytes().split(b"\0")
    grace = [e for e in environ if e.startswith(b"TORCH_ELASTIC_SHUTDOWN_TIMEOUT=")]
    assert grace == [f"TORCH_ELASTIC_SHUTDOWN_TIMEOUT={TORCHRUN_SHUTDOWN_TIMEOUT_S}".encode()]
    # rank 0's parent is torchrun, the supervisor's child: its record names that parent
    assert state["parent_pid"] != state["pid"] and alive(state["parent_pid"])

    stopped = await ctl.stop(timeout=budget.left())
    assert stopped.was_running and stopped.outcome in {"exited", "checkpointed"}, stopped
    assert stopped.checkpoint is not None and stopped.checkpoint.step >= first + 2, stopped
    assert Path(ctl.host.workdir, stopped.checkpoint.path).is_file()
    after = await ctl.status()
    assert after.state == "stopped", (after.state, after.last_error, after.pane_tail)
    sup = json.loads((run / "supervisor.json").read_text())
    assert sup["state"] == "stopped", sup  # an operator stop: never restarted
    # one SIGINT reached the ranks (torchrun passes the supervisor's on once): a graceful stop
    # that checkpointed and exited 0, not a second signal's immediate one
    final = json.loads((run / "run-state.json").read_text())
    assert (final["stop_signal"], final["signals"], final["exit_status"]) == ("SIGINT", 1, 0)
    assert final["last_checkpoint"] == stopped.checkpoint.path, final
    # the ranks exited with torchrun (killed session or not)
    await budget.until_async(lambda: not alive(rank0), "rank 0 to exit after the stop")


def test_group_launches_and_the_host_start_share_the_trainer_args() -> None:
    """`launch.TRAINER_ARGS` and the host argv's program part stay one thing."""
    from dflashctl.groups.launch import TRAINER_ARGS
    from dflashctl.remote.run import TORCHRUN_MODULE as GROUP_TORCHRUN

    assert GROUP_TORCHRUN == TORCHRUN_MODULE
    assert tuple(host_trainer_argv("py", False, nproc=3)[8:14]) == TRAINER_ARGS
