"""RunState reducer and HostFollower: replayed status lines in, the values the panes show out."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

import pytest

from dflashctl.humanize import format_age
from dflashctl.monitor.follower import HostFollower
from dflashctl.monitor.plan import (
    RunShape,
    boundaries,
    end_step,
    shape_from_config,
    total_steps,
    warmup_steps,
)
from dflashctl.monitor.state import (
    HISTORY,
    LOG_TAIL,
    RunState,
    apply_line,
    apply_lines,
    apply_status,
    bucket_labels,
    display_state,
)
from dflashctl.runs.follow import Backoff
from tests import budget
from tests.tui.fixtures import FIXED_NOW, ReplayControl, Status, run_lines, status_line
from trainer.config import TrainConfig
from trainer.config.schedule import lr_at
from trainer.events import run_state as contract

REPO_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"
SEED_WRAPPED = [  # the seed's own capture: tmux wrapped the lines at 80 columns
    "Starting pipeline...",
    "Pipeline running. Monitoring...",
    "[1m] step=2 loss=6.4079 acc=0.000 streak=0.0 lr=6.43e-07 noise=0.1000 | tgt=0.40b/s"
    " dft=0.30b/s (12.3Ktok/s) | q_pre=[10, 8, 8, 7, 6, 5] q_hs=[1] | epoch~0.00 ETA=5.1d",
]


def test_replayed_lines_fill_status_histories_and_tail() -> None:
    state = apply_lines(RunState("kpro6"), SEED_WRAPPED, FIXED_NOW)
    assert state.phase == "running"
    assert state.status is not None
    assert (state.status.step, state.status.ktok_s) == (2, 12.3)
    assert state.q_pre_hist == ((10, 8, 8, 7, 6, 5),)
    assert state.q_hs_hist == ((1,),)
    assert state.ktok_hist == (12.3,)
    assert state.loss_hist == (6.4079,)
    assert state.lines_seen == 3
    assert state.log_tail[-1] == SEED_WRAPPED[-1]
    assert state.last_line_at == FIXED_NOW


def test_missing_values_do_not_enter_histories() -> None:
    state = apply_lines(RunState("h"), [status_line(0), status_line(1)], FIXED_NOW)
    assert state.status is not None and state.status.step == 30
    assert len(state.loss_hist) == 1  # the first line had loss=---
    assert len(state.ktok_hist) == 2  # 0.0 Ktok/s is a value, and it is shown


def test_histories_and_tail_are_bounded() -> None:
    lines = run_lines(HISTORY + 50) + [f"noise {i}" for i in range(LOG_TAIL)]
    state = apply_lines(RunState("h"), lines, FIXED_NOW)
    assert len(state.ktok_hist) == HISTORY
    assert len(state.log_tail) == LOG_TAIL
    assert state.log_tail[-1] == f"noise {LOG_TAIL - 1}"
    assert state.lines_seen == len(lines)
    assert state.status is not None and state.status.step == 30 * (HISTORY + 49)


def test_checkpoint_and_error_lines_are_kept() -> None:
    state = apply_lines(
        RunState("h"),
        [
            "Checkpoint saved: step=1200 path=/opt/dflash/run/checkpoints/step-00001200.pt",
            "ERROR: CUDA out of memory on cuda:3",
            "Traceback (most recent call last):",
        ],
        FIXED_NOW,
    )
    assert state.checkpoint == (1200, "/opt/dflash/run/checkpoints/step-00001200.pt")
    assert state.last_error == "CUDA out of memory on cuda:3"
    assert state.log_tail[-1] == "Traceback (most recent call last):"


@pytest.mark.parametrize(
    ("exit_status", "trainer_state", "expected"),
    [(0, "finished", "finished"), (0, "stopped", "stopped"), (1, "finished", "crashed (exit 1)")],
)
def test_a_run_that_trained_its_whole_plan_shows_finished(
    exit_status: int, trainer_state: str, expected: str
) -> None:
    run = "stopped" if exit_status == 0 else "crashed"
    info = contract.RunState.model_validate({"state": trainer_state})
    state = RunState("h", run=run, exit_status=exit_status, run_info=info)
    assert display_state(state, FIXED_NOW) == expected


@pytest.mark.parametrize(
    ("run", "exit_status", "age", "link", "expected"),
    [
        ("running", None, 5.0, "live", "running"),
        ("running", None, 61.0, "live", "stale"),
        ("crashed", 137, 5.0, "live", "crashed (exit 137)"),
        ("crashed", None, 5.0, "live", "crashed (exit ?)"),
        ("stopped", 0, 5.0, "live", "stopped"),
        ("unreachable", None, 5.0, "retrying", "unreachable"),
        ("running", None, 5.0, "retrying", "unreachable"),
        ("unknown", None, None, "connecting", "connecting"),
    ],
)
def test_display_state(
    run: str, exit_status: int | None, age: float | None, link: str, expected: str
) -> None:
    """(The trainer's own "finished" is tested below: it needs run-state.json.)"""
    state = RunState(
        "h",
        run=run,
        exit_status=exit_status,
        link=link,  # type: ignore[arg-type]
        last_line_at=None if age is None else FIXED_NOW - age,
    )
    assert display_state(state, FIXED_NOW) == expected


def test_status_poll_sets_run_state_and_keeps_known_release() -> None:
    state = apply_status(RunState("h"), Status(state="running", release="abc123def456"))
    state = apply_status(state, Status(state="crashed", exit_status=1, release=None))
    assert (state.run, state.exit_status, state.release) == ("crashed", 1, "abc123def456")


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (None, "—"),
        (4.9, "4s"),
        (125, "2m05s"),
        (3 * 3600 + 720, "3h12m"),
        (2 * 86400 + 4 * 3600, "2d04h"),
    ],
)
def test_format_age(seconds: float | None, text: str) -> None:
    assert format_age(seconds) == text


def test_bucket_labels_from_boundaries_or_fallback() -> None:
    assert bucket_labels([0, 770, 1216], 2) == ["[0,770)", "[770,1216)"]
    assert bucket_labels([0, 770, 1216], 3) == ["b0", "b1", "b2"]
    assert bucket_labels(None, 1) == ["b0"]


def written_run_state(run_dir: Path, **fields: object) -> contract.RunState:
    """run-state.json as the trainer writes it (its one writer), read back as status does."""
    from trainer.pipeline.status import RunStateFile

    run_dir.mkdir(parents=True, exist_ok=True)
    writer = RunStateFile(run_dir)
    assert writer.update(**fields) == []
    parsed, problem = contract.parse_run_state(writer.path.read_text())
    assert problem is None
    return parsed


def test_total_and_warmup_steps_prefer_the_trainers_report(tmp_path: Path) -> None:
    shape = RunShape(total_steps=1000, epochs=6.0)
    state = apply_line(RunState("h"), status_line(5), FIXED_NOW)
    state = apply_status(state, Status(run_state=written_run_state(tmp_path, warmup_steps=40)))
    assert total_steps(shape, state) == 1000
    assert warmup_steps(shape, state) == 40
    info = written_run_state(tmp_path, total_steps=5000, warmup_steps=200)
    reported = apply_status(apply_line(state, status_line(6), FIXED_NOW), Status(run_state=info))
    assert (total_steps(shape, reported), warmup_steps(shape, reported)) == (5000, 200)
    # nothing reported and nothing in the config: unknown, never extrapolated or derived
    unknown = apply_line(RunState("h"), status_line(6), FIXED_NOW)
    assert unknown.status is not None and unknown.status.epoch
    assert (total_steps(RunShape(epochs=6.0), unknown), end_step(unknown)) == (None, None)
    assert warmup_steps(RunShape(epochs=6.0), unknown) is None


def test_run_state_json_supplies_total_warmup_and_planned_boundaries(tmp_path: Path) -> None:
    shape = RunShape(boundaries=None, epochs=2.0)
    state = apply_line(RunState("h"), status_line(5), FIXED_NOW)
    info = written_run_state(
        tmp_path, total_steps=1234, end_step=1000, warmup_steps=49, boundaries=[0, 24, 48, 96]
    )
    state = apply_status(state, Status(run_state=info))
    assert (total_steps(shape, state), warmup_steps(shape, state)) == (1234, 49)
    assert end_step(state) == 1000
    assert boundaries(shape, state) == [0, 24, 48, 96]
    assert bucket_labels(boundaries(shape, state), 3) == ["[0,24)", "[24,48)", "[48,96)"]
    # a later poll that found no run-state.json keeps the plan already known
    assert apply_status(state, Status()).run_info == info


def test_shape_from_the_bundled_config_uses_the_trainers_schedule() -> None:
    cfg = TrainConfig.load(REPO_CONFIG)
    shape = shape_from_config(REPO_CONFIG)
    assert shape.q_pre_capacity == cfg.topology.prefetch_depth
    assert shape.q_hs_capacity == cfg.topology.hidden_depth
    assert shape.epochs == cfg.schedule.epochs
    assert shape.schedule is not None
    for step in (0, 5, 39, 40, 500, 999):
        assert shape.schedule(step, 40, 1000) == lr_at(
            step,
            total_steps=1000,
            warmup_steps=40,
            peak=cfg.optimizer.lr,
            floor=cfg.schedule.min_lr,
        )
    assert shape_from_config(REPO_CONFIG.with_name("missing.toml")) == RunShape()


def test_backoff_is_capped_exponential() -> None:
    b = Backoff(initial=1.0, factor=2.0, maximum=30.0)
    assert [b.delay(i) for i in range(7)] == [1, 2, 4, 8, 16, 30, 30]


async def _until(predicate) -> None:  # type: ignore[no-untyped-def]
    await budget.until_async(predicate, every=0.01)


async def test_follower_streams_lines_and_polls_status() -> None:
    control = ReplayControl(lines=run_lines(5))
    published: list[RunState] = []
    follower = HostFollower("kpro6", control, published.append, clock=lambda: FIXED_NOW)
    task = asyncio.create_task(follower.run())
    try:
        await _until(lambda: follower.state.lines_seen == 7 and follower.state.run == "running")
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert follower.state.link == "live"
    assert follower.state.status is not None and follower.state.status.step == 120
    assert follower.state.release == "3f9a1c2b7d10"
    assert published[-1] is follower.state


async def test_failed_stream_retries_with_backoff_and_resumes_where_it_left() -> None:
    control = ReplayControl(lines=run_lines(3), fail_follow=1)
    follower = HostFollower(
        "kpro6", control, lambda s: None, clock=lambda: FIXED_NOW, backoff=Backoff(initial=30.0)
    )
    task = asyncio.create_task(follower.run())
    try:
        await _until(lambda: follower.state.link == "retrying")
        assert follower.state.retry_at == FIXED_NOW + 30.0
        assert "Connection refused" in (follower.state.link_error or "")
        assert display_state(follower.state, FIXED_NOW) == "unreachable"
        follower.reconnect_now()  # the `c` key: no 30 s wait
        await _until(lambda: follower.state.lines_seen == 5)
        control.lines.append(status_line(9))
        follower.reconnect_now()  # a reconnect follows from the last line read, no duplicates
        await _until(lambda: follower.state.lines_seen == 6)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    follows = [arg for name, arg in control.calls if name == "follow"]
    assert follows[:2] == [0, 0] and follows[-1] == 5
    assert follower.state.status is not None and follower.state.status.step == 270


async def test_shrunk_status_log_restarts_the_stream_from_zero() -> None:
    control = ReplayControl(lines=run_lines(4))
    follower = HostFollower("h", control, lambda s: None, clock=lambda: FIXED_NOW)
    task = asyncio.create_task(follower.run())
    try:
        await _until(lambda: follower.state.lines_seen == 6)
        control.lines[:] = run_lines(1)  # a fresh run started status.log over
        control.status_value = replace(control.status_value, log_lines=3)
        await follower.poll_status()
        await _until(
            lambda: (
                [a for n, a in control.calls if n == "follow"][-1] == 0
                and follower.state.lines_seen == 3
            )
        )
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert follower.state.status is not None and follower.state.status.step == 0


async def test_a_log_restart_reported_by_the_stream_resets_the_line_count() -> None:
    control = ReplayControl(lines=run_lines(4))
    follower = HostFollower("h", control, lambda s: None, clock=lambda: FIXED_NOW)
    task = asyncio.create_task(follower.run())
    try:
        await _until(lambda: follower.state.lines_seen == 6)
        control.lines[:] = run_lines(1)  # replaced while the link was down; no poll saw it
        follower.reconnect_now()  # the reconnect from line 6 asks how long the log is now
        await _until(lambda: ("log_line_count", None) in control.calls)
        await _until(lambda: follower.state.lines_seen == 3)
        await asyncio.sleep(0.05)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    assert follower.state.lines_seen == 3  # counted from the new log's first line, not 6 + 3
    assert follower.state.status is not None and follower.state.status.step == 0


def test_planned_boundaries_shown_are_the_trainers_from_run_state(tmp_path: Path) -> None:
    import subprocess
    import sys

    store = tmp_path / "store"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "trainer.data",
            "synth",
            "--lengths-from",
            "seed-shaped",
            "--vocab",
            "512",
            "--out",
            str(store),
            "--rows",
            "2000",
            "--max-length",
            "96",
        ],
        check=True,
        capture_output=True,
    )
    text = REPO_CONFIG.read_text().replace('store = ".cache/tiny-store"', f'store = "{store}"')
    config = tmp_path / "run.toml"
    config.write_text(text)
    cfg = TrainConfig.load(config)
    from trainer.buckets import plan_buckets, sampler_for
    from trainer.data.store import TokenStore

    b = cfg.batching
    expected = plan_buckets(
        TokenStore.open(store).lengths, b.num_buckets, b.token_budget, b.max_batch, simulate=False
    ).boundaries
    # the trainer plans them (its one sampler builder) and writes them to run-state.json
    sampler = sampler_for(cfg.batching, TokenStore.open(store).lengths, seed=cfg.seed)
    info = written_run_state(tmp_path / "run", boundaries=list(sampler.boundaries))
    shape = shape_from_config(config)
    state = apply_status(RunState("h"), Status(run_state=info))
    shown = boundaries(shape, state)
    assert shown is not None
    assert tuple(shown) == tuple(expected) and len(expected) == b.num_buckets + 1
    # not reported yet (and never planned here, store or not): no guess, the labels fall back
    assert shape.boundaries is None and boundaries(shape, RunState("h")) is None
    config.write_text(text.replace(str(store), str(tmp_path / "elsewhere")))
    assert shape_from_config(config).boundaries is None


async def test_first_follow_starts_where_the_panes_need_it_not_at_line_one() -> None:
    """A days-long status.log is not replayed from line 1: the first follow starts LOG_TAIL
    lines before the end (the panes keep no more), so what is shown is the same."""
    lines = run_lines(LOG_TAIL + 600)
    control = ReplayControl(lines=lines)
    control.status_value = replace(control.status_value, log_lines=len(lines))
    follower = HostFollower("h", control, lambda s: None, clock=lambda: FIXED_NOW)
    task = asyncio.create_task(follower.run())
    try:
        await _until(lambda: follower.state.lines_seen == len(lines))
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    follows = [arg for name, arg in control.calls if name == "follow"]
    assert follows == [len(lines) - LOG_TAIL]
    replayed = apply_lines(RunState(host="h"), lines, FIXED_NOW)
    assert follower.state.log_tail == replayed.log_tail
    assert follower.state.loss_hist == replayed.loss_hist  # HISTORY <= LOG_TAIL points
    assert follower.state.status == replayed.status


def test_an_earlier_runs_error_is_not_the_current_runs() -> None:
    lines = [
        "Loading target and data...",
        "ERROR: store /data/x is not a token store",
        *run_lines(2),  # a later run (a trainer without the loading phase line)
    ]
    state = apply_lines(RunState(host="h"), lines, FIXED_NOW)
    assert state.last_error is None
    state = apply_lines(state, ["ERROR: stage drafter failed: boom"], FIXED_NOW)
    assert state.last_error == "stage drafter failed: boom"
    state = apply_lines(state, ["Loading target and data..."], FIXED_NOW)  # the next run
    assert state.last_error is None
