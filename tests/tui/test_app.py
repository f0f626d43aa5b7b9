"""Pilot tests: the app's state and messages over replayed status lines (no terminal)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import NoReturn

from rich.console import Console
from rich.text import Text
from textual.message import Message
from textual.notifications import Notify
from textual.widgets import DataTable, Digits, Log, Static

from dflashctl.gpus.nvidia_smi import parse_gpu_csv
from dflashctl.monitor.restart_plan import RestartPlan
from dflashctl.monitor.state import RunState, apply_lines, apply_status
from dflashctl.releases.deploy import DeployResult, Progress
from dflashctl.tui.app import DflashApp, HostBinding
from dflashctl.tui.screens.confirm import ConfirmScreen
from dflashctl.tui.screens.fleet import FleetScreen, fleet_row
from dflashctl.tui.screens.help import HelpScreen, keymap_table
from dflashctl.tui.screens.host import HostScreen
from dflashctl.tui.screens.log import LogScreen
from dflashctl.tui.screens.restart import RestartScreen
from dflashctl.tui.widgets.panes import gpus_text, lr_points, queues_text
from tests import budget
from tests.tui.fixtures import (
    FIXED_NOW,
    WARMUP,
    ReplayControl,
    Status,
    deploy_result,
    run_lines,
    seed_shape,
    service,
    status_line,
)
from trainer.events import StatusEvent, parse_line

SIZE = (120, 40)


def _cell(table: DataTable[Text | str], host: str, column: str) -> str:
    value = table.get_cell(host, column)
    return value.plain if isinstance(value, Text) else str(value)


async def _until(pilot, predicate) -> None:  # type: ignore[no-untyped-def]
    """Until `predicate` holds, the app running meanwhile, within the test's one budget."""
    await budget.until_async(predicate, pause=pilot.pause, every=0.02)


def _live_app(**controls: ReplayControl) -> DflashApp:
    hosts = [
        HostBinding(name, service(control), shape=seed_shape())
        for name, control in controls.items()
    ]
    return DflashApp(hosts, clock=lambda: FIXED_NOW)


async def test_fleet_rows_come_from_the_streamed_status_lines() -> None:
    lines = run_lines(25)
    last = parse_line(lines[-1])
    assert isinstance(last, StatusEvent) and last.ktok_s is not None
    app = _live_app(
        kpro6=ReplayControl(lines=lines),
        kpro7=ReplayControl(
            lines=run_lines(3), status_value=Status(state="crashed", exit_status=1)
        ),
    )
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet", DataTable)
        await _until(pilot, lambda: table.row_count == 2 and _cell(table, "kpro6", "step") == "720")
        await _until(pilot, lambda: _cell(table, "kpro7", "state") == "crashed (exit 1)")
        assert _cell(table, "kpro6", "state") == "running"
        assert _cell(table, "kpro6", "ktok") == f"{last.ktok_s:.1f}"
        assert _cell(table, "kpro6", "eta") == "5.1d"
        assert _cell(table, "kpro6", "release") == "3f9a1c2b7d10"
        assert _cell(table, "kpro6", "age") == "0s"
        assert _cell(table, "kpro7", "step") == "60"


async def test_coalesced_refresh_draws_the_latest_line_not_every_line() -> None:
    app = DflashApp(
        [HostBinding("h", service(), shape=seed_shape())], clock=lambda: FIXED_NOW, live=False
    )
    async with app.run_test(size=SIZE) as pilot:
        await pilot.pause()
        frames = app.frames
        for i in range(200):  # a reconnect burst: 200 lines arrive between two ticks
            app.feed("h", [status_line(i)])
        app.flush()
        table = app.screen.query_one("#fleet", DataTable)
        assert _cell(table, "h", "step") == str(30 * 199)
        assert app.frames == frames + 1


def test_stale_and_unreachable_rows_show_their_age() -> None:
    state = apply_lines(
        RunState("kpro6", run="running", link="live"), run_lines(3), FIXED_NOW - 200
    )
    row = fleet_row(state, FIXED_NOW)
    assert (row["state"].plain, row["age"]) == ("stale", "3m20s")  # type: ignore[union-attr]
    down = apply_status(state, Status(state="unreachable", message="kpro6: ssh timed out"))
    assert fleet_row(down, FIXED_NOW)["state"].plain == "unreachable"  # type: ignore[union-attr]
    assert down.link_error == "kpro6: ssh timed out"


async def test_host_screen_panes_show_the_run() -> None:
    lines = run_lines(30, starve=2, w_tgt_in="41", bottleneck="prefetch")
    app = _live_app(kpro6=ReplayControl(lines=lines))
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: app.states["kpro6"].lines_seen == len(lines))
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen))
        screen = app.screen
        await _until(pilot, lambda: screen.query_one("#ktok-digits", Digits).value != "—")
        last = parse_line(lines[-1])
        assert isinstance(last, StatusEvent) and last.ktok_s is not None
        assert screen.query_one("#ktok-digits", Digits).value == f"{last.ktok_s:.1f}"
        queues = str(screen.query_one("#queues", Static).content)
        assert "[1216,1728)" in queues and "0/50" in queues  # the starved bucket, by length range
        assert "bottleneck prefetch" in queues and "w_tgt_in=41%" in queues
        lr = str(screen.query_one("#lr", Static).content)
        assert f"870/{WARMUP} (24%)" in lr
        eta = str(screen.query_one("#eta", Static).content)
        assert "5.1d" in eta and "/ 6" in eta
        log = screen.query_one("#host-log", Log)
        assert log.lines[-1] == lines[-1]
        await pilot.press("escape")
        assert isinstance(app.screen, FleetScreen)


def test_queue_pane_labels_buckets_and_marks_starvation() -> None:
    state = apply_lines(RunState("h"), run_lines(20, starve=0), FIXED_NOW)
    text = queues_text(state, seed_shape(), 80)
    first = text.plain.splitlines()[1]
    assert first.lstrip().startswith("[0,770)") and " 0/50" in first
    starved = [span for span in text.spans if span.style == "red"]
    assert starved, "an empty queue must be drawn in red"


def test_lr_curve_marks_the_current_step_inside_warmup() -> None:
    state = apply_lines(RunState("h"), [status_line(40)], FIXED_NOW)  # step 1200 of 3598 warmup
    values, marker, end = lr_points(seed_shape(), state, 60)
    assert end == 3 * WARMUP
    assert marker == round(1200 / (end - 1) * 59)
    peak = values.index(max(values))
    assert marker < peak  # still climbing: warmup not done
    assert values[0] < values[marker] < values[peak]


async def test_keys_open_log_help_and_stop_confirm() -> None:
    control = ReplayControl(lines=run_lines(5))
    app = _live_app(kpro6=control)
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: app.states["kpro6"].lines_seen == 7)
        await pilot.press("l")
        await _until(pilot, lambda: isinstance(app.screen, LogScreen))
        await _until(pilot, lambda: len(app.screen.query_one("#full-log", Log).lines) == 7)
        await pilot.press("escape", "question_mark")
        assert isinstance(app.screen, HelpScreen)
        await pilot.press("escape", "s")
        assert isinstance(app.screen, ConfirmScreen)
        await pilot.press("escape")  # cancelled: nothing stopped
        assert ("stop", 120.0) not in control.calls
        await pilot.press("s", "y")
        await _until(pilot, lambda: ("stop", 120.0) in control.calls)
        await _until(pilot, lambda: app.states["kpro6"].run == "stopped")


async def test_a_failed_service_call_is_one_titled_error_notification() -> None:
    """Workers raise; the app's one router words the failure (host, what failed, the error)."""

    class Refusing(ReplayControl):
        async def stop(self, timeout: float = 120.0) -> NoReturn:
            raise RuntimeError("pct: container 206 is locked")

    control = Refusing(lines=run_lines(1))
    app = _live_app(kpro6=control)
    seen: list[Message] = []
    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await _until(pilot, lambda: app.states["kpro6"].lines_seen == 3)
        await pilot.press("s", "y")

        def failures() -> list[tuple[str, str, str]]:
            return [
                (m.notification.title, m.notification.message, m.notification.severity)
                for m in seen
                if isinstance(m, Notify) and m.notification.severity == "error"
            ]

        await _until(pilot, lambda: bool(failures()))
        assert failures() == [("Stop", "kpro6: stop failed: pct: container 206 is locked", "error")]
        assert isinstance(app.screen, FleetScreen)  # the app goes on


async def test_reconnect_key_restarts_the_stream() -> None:
    control = ReplayControl(lines=run_lines(2))
    app = _live_app(kpro6=control)
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: app.states["kpro6"].lines_seen == 4)
        control.lines.append(status_line(7))
        await pilot.press("c")
        await _until(pilot, lambda: app.states["kpro6"].lines_seen == 5)
    assert [a for n, a in control.calls if n == "follow"] == [0, 4]


async def test_restart_modal_refuses_an_invalid_plan_and_cancel_calls_nothing(
    tmp_path: Path,
) -> None:
    control = ReplayControl(lines=run_lines(2))
    app = _live_app(kpro6=control)
    async with app.run_test(size=SIZE) as pilot:
        plan = RestartPlan(diff="", fresh=False, error="run.toml: [batching] boundaries must rise")
        app.push_screen(
            RestartScreen("kpro6", plan, lambda report: app.keys.do_restart("kpro6", plan, report))
        )
        await pilot.pause()
        assert "cannot restart: run.toml" in str(app.screen.query_one("#verdict", Static).content)
        await pilot.click("#confirm")
        await pilot.press("escape")
        assert not isinstance(app.screen, RestartScreen)
    assert not [c for c in control.calls if c[0] == "restart"]


REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"


def _configs(tmp_path: Path, old: str, new: str) -> tuple[str, Path]:
    deployed = REPO_CONFIG.read_text()
    assert old in deployed
    local = tmp_path / "kpro6.toml"
    local.write_text(deployed.replace(old, new))
    return deployed, local


async def _restart_via_keys(
    tmp_path: Path, old: str, new: str
) -> tuple[ReplayControl, DflashApp, str, str]:
    deployed, local = _configs(tmp_path, old, new)
    control = ReplayControl(lines=run_lines(3), deployed=deployed)
    app = DflashApp(
        [HostBinding("kpro6", service(control), config_path=local, shape=seed_shape())],
        clock=lambda: FIXED_NOW,
    )
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: app.states["kpro6"].config_changed)
        table = app.screen.query_one("#fleet", DataTable)
        await _until(pilot, lambda: _cell(table, "kpro6", "config") == "changed")
        await pilot.press("r")
        await _until(pilot, lambda: isinstance(app.screen, RestartScreen))
        modal = app.screen
        assert isinstance(modal, RestartScreen)
        shown = modal.query_one("#diff", Static).content
        diff = getattr(shown, "code", str(shown))  # a rich Syntax holding the unified diff
        verdict = str(modal.query_one("#verdict", Static).content)
        await pilot.press("enter")  # the confirm button has focus
        await _until(pilot, lambda: modal.result is not None)
        assert "restarted" in modal.result  # type: ignore[operator]
        await pilot.press("enter")  # "Close"
        await _until(pilot, lambda: not isinstance(app.screen, RestartScreen))
        await _until(pilot, lambda: not app.states["kpro6"].config_changed)
        return control, app, diff, verdict


async def test_restart_with_a_resumable_change_resumes(tmp_path: Path) -> None:
    control, _, diff, verdict = await _restart_via_keys(
        tmp_path, "interval_s = 2", "interval_s = 1"
    )
    assert "-interval_s = 2" in diff and "+interval_s = 1" in diff
    assert "resume from the latest checkpoint" in verdict
    [(fresh, path)] = [arg for name, arg in control.calls if name == "restart"]
    assert fresh is False and path == tmp_path / "kpro6.toml"
    assert control.deployed == (tmp_path / "kpro6.toml").read_text()  # pushed


async def test_restart_with_a_resume_critical_change_starts_fresh_naming_the_key(
    tmp_path: Path,
) -> None:
    control, app, diff, verdict = await _restart_via_keys(
        tmp_path, "num_buckets = 4", "num_buckets = 3"
    )
    assert "+num_buckets = 3" in diff
    assert "start FRESH" in verdict and "batching.num_buckets" in verdict
    [(fresh, _)] = [arg for name, arg in control.calls if name == "restart"]
    assert fresh is True
    state = app.states["kpro6"]
    assert state.ktok_hist == () and state.status is None  # the new run's curves start empty
    assert state.lines_seen == 5  # status.log keeps growing: the follow position carries on


async def test_restart_verdict_compares_with_the_checkpoint_not_the_last_push(
    tmp_path: Path,
) -> None:
    """A breaking config was pushed (deployed) by mistake; the local one matches the checkpoint:
    the modal must offer a resume, not a fresh start that would set the progress aside."""
    checkpoint_text = REPO_CONFIG.read_text()
    deployed = checkpoint_text.replace("num_buckets = 4", "num_buckets = 3")
    local = tmp_path / "kpro6.toml"
    local.write_text(checkpoint_text.replace("interval_s = 2", "interval_s = 1"))
    control = ReplayControl(lines=run_lines(2), deployed=deployed, checkpoint_text=checkpoint_text)
    app = DflashApp(
        [HostBinding("kpro6", service(control), config_path=local)], clock=lambda: FIXED_NOW
    )
    plan = await app.keys.build_restart_plan("kpro6")
    assert not plan.fresh and plan.critical_keys == ()
    assert "resume from the latest checkpoint" in plan.verdict
    assert "-num_buckets = 3" in plan.diff  # the diff still shows what the push changes
    control.checkpoint_text = deployed  # now the checkpoint itself has 3 buckets
    plan = await app.keys.build_restart_plan("kpro6")
    assert plan.fresh and plan.critical_keys == ("batching.num_buckets",)


async def test_invalid_local_config_refuses_restart_naming_file_and_key(tmp_path: Path) -> None:
    deployed, local = _configs(tmp_path, "num_buckets = 4", "num_buckets = 0")
    control = ReplayControl(lines=run_lines(2), deployed=deployed)
    app = DflashApp(
        [HostBinding("kpro6", service(control), config_path=local)], clock=lambda: FIXED_NOW
    )
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: app.states["kpro6"].lines_seen == 4)
        await pilot.press("r")
        await _until(pilot, lambda: isinstance(app.screen, RestartScreen))
        verdict = str(app.screen.query_one("#verdict", Static).content)
        assert "cannot restart" in verdict and "kpro6.toml" in verdict and "num_buckets" in verdict
        await pilot.press("enter", "escape")
    assert not [c for c in control.calls if c[0] == "restart"]


def test_gpu_pane_shows_each_gpu_from_nvidia_smi_samples() -> None:
    csv = "0, NVIDIA RTX PRO 6000, 97, 81234, 97887, 71, 402.5\n1, NVIDIA RTX PRO 6000, 3, 512, 97887, 88, 61.0\n"
    state = replace(RunState("kpro6"), gpus=tuple(parse_gpu_csv(csv)))
    text = gpus_text(state)
    first, second = text.plain.splitlines()
    assert (
        first.startswith("GPU0")
        and " 97%" in first
        and "81234/97887 MiB" in first
        and "71°C" in first
    )
    assert second.startswith("GPU1") and "  3%" in second and "88°C" in second
    assert any(span.style == "bold red" for span in text.spans)  # 88 °C is flagged
    assert "no GPU samples" in gpus_text(RunState("cpu-only")).plain


async def test_deploy_key_runs_the_hosts_deploy_and_reports_the_release() -> None:
    deployed: list[str] = []

    async def deploy(*, progress: Progress | None = None, fresh: bool = False) -> DeployResult:
        deployed.append("kpro6")
        return deploy_result("3f9a1c2b7d10")

    control = ReplayControl(lines=run_lines(2))
    app = DflashApp(
        [
            HostBinding("kpro6", service(control), deploy=deploy),
            HostBinding("kpro7", service()),
        ],
        clock=lambda: FIXED_NOW,
    )
    seen: list[Message] = []

    def said(text: str) -> bool:
        return any(isinstance(m, Notify) and text in m.notification.message for m in seen)

    async with app.run_test(size=SIZE, message_hook=seen.append) as pilot:
        await _until(pilot, lambda: app.states["kpro6"].lines_seen == 4)
        await pilot.press("d")
        await _until(pilot, lambda: said("kpro6: deployed release 3f9a1c2b7d10"))
        await pilot.press("down", "d")  # kpro7 has no deploy: said, not crashed
        await _until(pilot, lambda: said("kpro7: deploy is not available"))
    assert deployed == ["kpro6"]


async def test_a_dead_host_over_real_ssh_is_unreachable_and_never_blocks_the_app(
    tmp_path: Path,
) -> None:
    """Real RunControl over a real SshTransport to a port nobody listens on."""
    import socket

    from dflashctl.config.inventory import load_inventory
    from dflashctl.remote.ssh import SshTransport
    from dflashctl.runs.control import RunControl

    with socket.socket() as s:  # a free port, closed again: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    (tmp_path / "known_hosts").write_text("")
    inv = tmp_path / "hosts.toml"
    inv.write_text(
        f'[hosts.kpro9]\naddress = "127.0.0.1"\nport = {port}\nctid = 109\n'
        f'known_hosts = "{tmp_path / "known_hosts"}"\nconnect_timeout = 2\n'
    )
    host = load_inventory(inv).get("kpro9")
    transport = SshTransport(host)
    live = ReplayControl(lines=run_lines(3))
    app = DflashApp(
        [
            HostBinding("kpro9", RunControl(transport, host), close=transport.close),
            HostBinding("kpro6", service(live), shape=seed_shape()),
        ]
    )
    async with app.run_test(size=SIZE) as pilot:
        table = app.screen.query_one("#fleet", DataTable)
        # one look at both: a reconnect attempt clears link_error while the run stays
        # unreachable, and a loaded machine can be in one when the row first says so
        await _until(
            pilot,
            lambda: (
                _cell(table, "kpro9", "state") == "unreachable"
                and "kpro9" in (app.states["kpro9"].link_error or "")
            ),
        )
        await _until(pilot, lambda: _cell(table, "kpro6", "state") == "running")
        await pilot.press("question_mark")  # the app still answers keys
        assert isinstance(app.screen, HelpScreen)


async def test_help_says_what_quit_does_in_this_app() -> None:
    """The demo stops its run on `q`; the help must not promise that runs keep going there."""
    stops = "quit and stop the demo run gracefully"
    host = HostBinding("demo", service(ReplayControl(lines=run_lines(2))), shape=seed_shape())
    app = DflashApp([host], clock=lambda: FIXED_NOW, quit_action=stops)
    async with app.run_test(size=SIZE) as pilot:
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        console = Console(record=True, width=120)
        console.print(keymap_table(app.screen.quit_action))
        text = console.export_text()
        assert stops in text and "runs keep going" not in text
    console = Console(record=True, width=120)
    console.print(keymap_table())
    assert "quit (the runs keep going)" in console.export_text()


async def test_hostile_bytes_in_status_log_never_reach_the_screen(tmp_path: Path) -> None:
    """OSC title, OSC 52 clipboard and colour codes in a real status.log, read by a real
    RunControl over LocalTransport: the header, the log pane and the fleet row show clean text
    (escape bytes would leave stale cells in the header and retitle the terminal)."""
    import shutil
    import sys

    from dflashctl.config.inventory import local_host
    from dflashctl.remote import LocalTransport
    from dflashctl.runs.control import RunControl
    from tests.conftest import require_part

    require_part(shutil.which("tmux") is not None, "tmux not installed")
    (tmp_path / "tmux").mkdir()
    transport = LocalTransport(env={"TMUX_TMPDIR": str(tmp_path / "tmux")})
    host = local_host("evil", tmp_path / "wd", python=sys.executable, session="t")
    run = tmp_path / "wd" / "run"
    run.mkdir(parents=True)
    line = status_line(3)
    (run / "status.log").write_text(
        "Starting pipeline...\n"
        "\x1b]0;PWNED-TITLE\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[31mERROR: red alert\x1b[0m\n"
        f"\x1b[32m{line}\x1b[0m\x1b[2K\n"
    )
    app = DflashApp([HostBinding("evil", RunControl(transport, host), close=transport.close)])
    async with app.run_test(size=SIZE) as pilot:
        await _until(pilot, lambda: app.states["evil"].lines_seen == 3)
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen))
        screen = app.screen
        await pilot.pause(0.3)
        header = screen.query_one("#host-header", Static).content
        text = header.plain if isinstance(header, Text) else str(header)
        assert "error: red alert" in text and app.states["evil"].status.step == 90  # type: ignore[union-attr]
        shown = [*screen.query_one("#host-log", Log).lines, text]
        assert screen.query_one("#host-log", Log).lines[-1] == line
        assert not any(ch in s for s in shown for ch in "\x1b\x07\x9b\x9d")
        assert "PWNED" not in " ".join(shown) and "cm0gLXJmIH4" not in " ".join(shown)
