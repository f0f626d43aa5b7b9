"""SVG snapshots of the canonical screens with a fixed clock, fixed data and a fixed terminal.

Update (after looking at the report): `pytest tests/tui/test_snapshots.py --snapshot-update`.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from dflashctl.config.runconfig import config_diff
from dflashctl.gpus.nvidia_smi import parse_gpu_csv, parse_health_csv
from dflashctl.monitor.restart_plan import RestartPlan
from dflashctl.monitor.state import LinkState, RunState, apply_lines, apply_status
from dflashctl.tui.app import DflashApp, HostBinding
from dflashctl.tui.screens.host import HostScreen
from dflashctl.tui.screens.restart import RestartScreen
from tests import budget
from tests.tui.fixtures import (
    FIXED_NOW,
    Status,
    eval_run_lines,
    run_lines,
    seed_shape,
    service,
)
from trainer.events import run_state as contract

SIZE = (120, 40)
GPU_FIXTURES = Path(__file__).parents[1] / "ctl" / "fixtures" / "gpu-health"

DEPLOYED = """\
[batching]
strategy = "sorted"
boundaries = [0, 8192]
token_budget = 49152

[optim]
lr = 6e-4
warmup_ratio = 0.04
"""
LOCAL = """\
[batching]
strategy = "bucketed"
boundaries = [0, 770, 1216, 1728, 2432, 3296, 8192]
token_budget = 49152

[optim]
lr = 6e-4
warmup_ratio = 0.04
"""


async def _painted(pilot) -> None:  # type: ignore[no-untyped-def]
    """Wait (within the test's budget) until the host screen drew its panes at their laid-out
    size."""
    await _screen_painted(pilot, HostScreen)


async def _screen_painted(pilot, screen: type) -> None:  # type: ignore[no-untyped-def]
    async def pause(seconds: float) -> None:
        await pilot.pause(seconds)
        pilot.app.flush()

    await budget.until_async(
        lambda: (
            isinstance(pilot.app.screen, screen) and getattr(pilot.app.screen, "painted", False)
        ),
        f"the {screen.__name__} painted",
        pause=pause,
    )
    await pilot.pause()


# kpro6 was restarted once by its supervisor, 3m05s before the fixed clock
KILLED = {
    "at": "2027-01-15T07:56:55Z",
    "attempt": 2,
    "reason": "signal 9",
    "exit_status": -9,
    "checkpoint_step": 1000,
    "resumed_step": 1000,
    "backoff_s": 10.0,
}
SUPERVISED = {"state": "running", "gave_up": False, "detail": None, "policy": {"max_restarts": 3}}


def fleet_app() -> DflashApp:
    """Four hosts in the four states that matter: live, stale, crashed, unreachable."""
    names = ["kpro6", "kpro7", "kpro8", "kpro9"]
    app = DflashApp(
        [HostBinding(n, service(), shape=seed_shape()) for n in names],
        clock=lambda: FIXED_NOW,
        live=False,
    )
    states: dict[str, tuple[Status, list[str], float, LinkState, bool]] = {
        "kpro6": (
            Status(restarts=[KILLED], supervisor=SUPERVISED),
            run_lines(40),
            2.0,
            "live",
            False,
        ),
        "kpro7": (Status(), run_lines(30, starve=3), 95.0, "live", True),
        "kpro8": (Status(state="crashed", exit_status=1), run_lines(12), 600.0, "live", False),
        "kpro9": (
            Status(state="unreachable", release=None, message="kpro9: ssh: connect timed out"),
            run_lines(20),
            4000.0,
            "retrying",
            False,
        ),
    }
    for name, (status, lines, age, link, changed) in states.items():
        st = apply_lines(RunState(name), lines, FIXED_NOW - age)
        st = apply_status(st, status)
        st = replace(st, link=link, config_changed=changed, release=st.release or "3f9a1c2b7d10")
        if link == "retrying":
            st = replace(st, link_error="ssh: connect timed out", retry_at=FIXED_NOW + 16)
        app.states[name] = st
    return app


def test_fleet_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    assert snap_compare(fleet_app(), terminal_size=SIZE)


def test_host_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def open_host(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("enter")
        await _painted(pilot)

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=open_host)


def test_stale_host_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    async def open_stale(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("down", "enter")
        await _painted(pilot)

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=open_stale)


def eval_app() -> DflashApp:
    """One host 48 status lines in, nine held-out evaluations read (tau climbing from 1.0 to
    2.81, the best at step 1350 with its checkpoint in run-state.json), per-bucket losses, and
    two H100s from the captured nvidia-smi output: one throttled by the board, one with ECC
    errors."""
    app = DflashApp(
        [HostBinding("kpro6", service(), shape=seed_shape())],
        clock=lambda: FIXED_NOW,
        live=False,
    )
    info = contract.RunState(
        warmup_steps=900,
        best_step=1350,
        best_tau=2.81,
        best_checkpoint="run/checkpoints/step-00001350.pt",
    )
    st = apply_lines(RunState("kpro6"), eval_run_lines(48), FIXED_NOW - 40)
    st = apply_status(st, Status(run_state=info))
    health_csv = (GPU_FIXTURES / "h100x8-driver550.csv").read_text().splitlines()[4:6]
    health, _ = parse_health_csv("\n".join(health_csv))
    samples = "4, NVIDIA H100 80GB HBM3, 98, 71234, 81559, 86, 688.0\n"
    samples += "5, NVIDIA H100 80GB HBM3, 97, 70991, 81559, 64, 655.2\n"
    app.states["kpro6"] = replace(
        st, link="live", gpus=tuple(parse_gpu_csv(samples)), gpu_health=tuple(health)
    )
    return app


def test_eval_host_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    """The "on track?" panes with fixed data: eval (tau history, best marked, acc@k bars, best
    checkpoint), the loss chart with its warmup marker, per-bucket loss, GPU ECC / throttle."""

    async def open_host(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("enter")
        await _painted(pilot)

    assert snap_compare(eval_app(), terminal_size=SIZE, run_before=open_host)


def test_restart_modal(snap_compare) -> None:  # type: ignore[no-untyped-def]
    plan = RestartPlan(
        diff=config_diff(
            DEPLOYED, LOCAL, old_name="deployed: run/config.toml", new_name="local: runs/kpro7.toml"
        ),
        fresh=True,
        critical_keys=("batching.boundaries", "batching.strategy"),
    )

    async def open_modal(pilot) -> None:  # type: ignore[no-untyped-def]
        async def never(report):  # type: ignore[no-untyped-def]
            raise AssertionError("the snapshot must not run the restart")

        pilot.app.push_screen(RestartScreen("kpro7", plan, never))
        await pilot.pause()

    assert snap_compare(fleet_app(), terminal_size=SIZE, run_before=open_modal)


def group_app() -> DflashApp:
    """`pair` (n0 node 0, n1 node 1; one rank each) and a single host: n0 streams the run's
    status lines and has two H100s, one with Xids in its node's kernel log (three from before
    the view, one since); n1 has been unreachable for 5 minutes; solo runs on its own."""
    from dflashctl.gpus.xid_log import parse_xid_lines
    from dflashctl.monitor.state import apply_xids
    from tests.tui.fixtures import node_run_state

    names = ["n0", "n1", "solo"]
    app = DflashApp(
        [HostBinding(n, service(), shape=seed_shape()) for n in names],
        clock=lambda: FIXED_NOW,
        live=False,
        groups={"pair": ("n0", "n1")},
    )
    bus = "00000000:9A:00.0"
    health, _ = parse_health_csv(
        f"0, {bus}, Enabled, 0, 0, 0, 0x0000000000000000, Not Active, Not Active, Not Active,"
        " Not Active, Not Active\n"
        "1, 00000000:9B:00.0, Enabled, 0, 0, 0, 0x0000000000000000, Not Active, Not Active,"
        " Not Active, Not Active, Not Active\n"
    )
    samples = "0, NVIDIA H100 80GB HBM3, 98, 71234, 81559, 70, 688.0\n"
    samples += "1, NVIDIA H100 80GB HBM3, 97, 70991, 81559, 64, 655.2\n"
    n0 = apply_lines(RunState("n0"), run_lines(40), FIXED_NOW - 2)
    n0 = apply_status(n0, Status(run_state=node_run_state(0, step=1170)))
    n0 = replace(n0, link="live", gpus=tuple(parse_gpu_csv(samples)), gpu_health=tuple(health))
    kernel = (GPU_FIXTURES / "journalctl-xid.txt").read_text()
    n0 = apply_xids(n0, parse_xid_lines(kernel), FIXED_NOW - 3600, history=True)
    fell = parse_xid_lines(
        "[ 9843.308151] NVRM: Xid (PCI:0000:9a:00): 79, pid=41233, name=python, GPU has fallen"
        " off the bus.\n"
    )
    n0 = apply_xids(n0, fell, FIXED_NOW - 65)
    n1 = apply_status(RunState("n1"), Status(run_state=node_run_state(1, step=1170)))
    n1 = apply_status(n1, Status(state="unreachable", message="n1: ssh: connect timed out"))
    n1 = replace(n1, link="retrying", link_error="ssh: connect timed out",
                 retry_at=FIXED_NOW + 16, unreachable_since=FIXED_NOW - 300)  # fmt: skip
    solo = apply_status(apply_lines(RunState("solo"), run_lines(12), FIXED_NOW - 4), Status())
    app.states.update(n0=n0, n1=n1, solo=replace(solo, link="live"))
    return app


def test_group_fleet_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    """The group's row opened into its nodes: degraded by the unreachable node, never crashed."""

    async def open_group(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("space")
        await pilot.pause()

    assert snap_compare(group_app(), terminal_size=SIZE, run_before=open_group)


def test_group_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    """Every node in rank order, node 0's queues, each node's GPU pane (n0's Xids)."""
    from dflashctl.tui.screens.group import GroupScreen

    async def open_group(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("enter")
        await _screen_painted(pilot, GroupScreen)

    assert snap_compare(group_app(), terminal_size=SIZE, run_before=open_group)


def test_measuring_host_screen(snap_compare) -> None:  # type: ignore[no-untyped-def]
    """A host whose run stopped, now running `dflashctl measure`: the header says measuring,
    the measure line under it has its id, since when, the commands and its last progress."""
    from dflashctl.runs.snapshot import RunningMeasure

    measure = RunningMeasure(
        id="20270115T074002Z",
        session="dflash-measure",
        since="2027-01-15 07:40:02 UTC",
        age_s=1198.0,
        progress="round 1/2 packed: 17,412 tok/s (run 4 of 10)",
    )
    app = DflashApp(
        [HostBinding("kpro6", service(), shape=seed_shape())],
        clock=lambda: FIXED_NOW,
        live=False,
    )
    st = apply_lines(RunState("kpro6"), run_lines(40), FIXED_NOW - 1300)
    st = apply_status(st, Status(state="stopped", exit_status=0, measure=measure))
    app.states["kpro6"] = replace(st, link="live")

    async def open_host(pilot) -> None:  # type: ignore[no-untyped-def]
        await pilot.press("enter")
        await _painted(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=open_host)
