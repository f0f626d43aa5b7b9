"""Trackers in a real training run: TensorBoard holds exactly the figures the run printed (status
lines at their steps, Eval lines at theirs), status lines carry tau= and loss_b=, only rank 0
logs, and a tracker that cannot start is one warning line, never a failed run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests import budget
from trainer.events import (
    BUCKET_LOSS_KEY,
    TAU_KEY,
    EvalEvent,
    StatusEvent,
    parse_bucket_losses,
    parse_line,
    parse_text,
)
from trainer.pipeline.status import WARNING_PREFIX
from trainer.tracking import eval_scalars, status_scalars

from .conftest import REPO, RunCli, cli_env, run_two_ranks, write_config

EVAL = {"holdout_rows": 48, "every_steps": 10, "max_rows": 16}
TRACK = {"backends": ["tensorboard"]}


def _events(run_dir: Path) -> list[Any]:
    return parse_text((run_dir / "status.log").read_text())


def _tb_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in RUN/tb, read by TensorBoard's own EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}


def _expected(evs: list[Any]) -> dict[str, list[tuple[int, float]]]:
    """The tracker tags of every printed status and eval event, in print order."""
    out: dict[str, list[tuple[int, float]]] = {}
    for ev in evs:
        if isinstance(ev, StatusEvent):
            scalars = status_scalars(ev)
        elif isinstance(ev, EvalEvent):
            scalars = eval_scalars(ev)
        else:
            continue
        for tag, value in scalars.items():
            out.setdefault(tag, []).append((ev.step, value))
    return out


Series = dict[str, list[tuple[int, float]]]


def _assert_same_series(got: Series, want: Series) -> None:
    assert sorted(got) == sorted(want)
    for tag, points in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in points], tag
        for (_, a), (_, b) in zip(got[tag], points, strict=True):
            assert a == pytest.approx(b, rel=1e-6, abs=1e-6), tag  # float32 in the event file


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory: pytest.TempPathFactory, tiny_assets: dict[str, Any]) -> Path:
    tmp = tmp_path_factory.mktemp("tracked")
    cfg = write_config(
        tmp / "run.toml",
        tiny_assets,
        schedule={"max_steps": 40},
        eval=EVAL,
        tracking=TRACK,
        status={"interval_s": 0.25},
    )
    out = subprocess.run(
        [sys.executable, "-m", "trainer", "--config", str(cfg), "--run-dir", str(tmp / "run")],
        cwd=REPO,
        env=cli_env(),
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return tmp / "run"


def test_tensorboard_holds_every_printed_status_and_eval_figure(tracked_run: Path) -> None:
    evs = _events(tracked_run)
    statuses = [e for e in evs if isinstance(e, StatusEvent)]
    evals = [e for e in evs if isinstance(e, EvalEvent)]
    assert [e.step for e in evals] == [0, 10, 20, 30, 40]
    assert len(statuses) >= 3
    files = list((tracked_run / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    got = _tb_scalars(tracked_run / "tb")
    _assert_same_series(got, _expected(evs))
    assert {"train/loss", "train/lr", "speed/ktok_s", "wait/w_dft_in", "eval/tau"} <= set(got)
    assert [s for s, _ in got["eval/tau"]] == [0, 10, 20, 30, 40]
    assert "train/loss_b0" in got  # per-bucket loss reaches the tracker too


def test_status_lines_carry_tau_after_the_first_eval_and_loss_per_bucket(
    tracked_run: Path,
) -> None:
    state = json.loads((tracked_run / "run-state.json").read_text())
    n_buckets = len(state["boundaries"]) - 1
    assert n_buckets > 1
    lines = (tracked_run / "status.log").read_text().splitlines()
    taus: list[str] = []  # the Eval lines' tau so far, as printed on status lines
    with_tau = 0
    for line in lines:
        ev = parse_line(line)
        if isinstance(ev, EvalEvent):
            assert ev.tau is not None
            taus.append(f"{ev.tau:.3f}")
            continue
        if not isinstance(ev, StatusEvent):
            continue
        keys = list(ev.extra)
        assert BUCKET_LOSS_KEY in keys, line
        if TAU_KEY in keys:  # right after gnorm, then loss_b: the fast path's order
            assert keys.index(TAU_KEY) + 1 == keys.index(BUCKET_LOSS_KEY)
        if taus:  # printed after an Eval line: its tau (or the one before, built just before)
            assert ev.extra.get(TAU_KEY) in taus[-2:], line
            with_tau += 1
        buckets = parse_bucket_losses(ev.extra[BUCKET_LOSS_KEY])
        assert buckets is not None and len(buckets) == n_buckets, line
        seen = [x for x in buckets if x is not None]
        if ev.loss is not None and seen and ev.step > 0:
            # the interval's loss is the weighted mean of its buckets' losses (4 decimals shown)
            assert min(seen) - 1e-4 <= ev.loss <= max(seen) + 1e-4, line
    assert with_tau >= 2
    shown = [
        parse_bucket_losses(ev.extra[BUCKET_LOSS_KEY])
        for x in lines
        if "loss_b=" in x and isinstance(ev := parse_line(x), StatusEvent)
    ]
    assert any(v is not None for b in shown for v in b or [])


def test_a_tensorboard_dir_that_is_a_file_is_one_warning_and_the_run_finishes(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "tb").write_text("not a directory\n")
    cfg = write_config(
        tmp_path / "run.toml", tiny_assets, schedule={"max_steps": 6}, tracking=TRACK
    )
    out = run_cli(cfg, run_dir)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    warnings = [x for x in out.stdout.splitlines() if x.startswith(WARNING_PREFIX)]
    assert len(warnings) == 1 and "tensorboard" in warnings[0], out.stdout
    assert not [x for x in out.stdout.splitlines() if x.startswith("ERROR")], out.stdout
    state = json.loads((run_dir / "run-state.json").read_text())
    assert state["state"] == "finished" and state["last_error"] is None
    assert (run_dir / "tb").read_text() == "not a directory\n"
    assert warnings[0] in (run_dir / "status.log").read_text()


@pytest.mark.timeout(240)
def test_only_rank_zero_logs_under_two_gloo_ranks(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    cfg = write_config(
        tmp_path / "dp.toml",
        tiny_assets,
        topology={"drafter_devices": ["cpu", "cpu"], "target_devices": ["cpu"]},
        schedule={"max_steps": 6},
        eval={"holdout_rows": 48, "every_steps": 3, "max_rows": 8},
        tracking=TRACK,
    )
    run_dir = tmp_path / "run"
    out = run_two_ranks(cfg, run_dir)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    files = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer: rank 0's
    got = _tb_scalars(run_dir / "tb")
    _assert_same_series(got, _expected(_events(run_dir)))
    assert [s for s, _ in got["eval/tau"]] == [0, 3, 6]


def test_a_resumed_run_replaces_the_steps_it_retrains_in_tensorboard(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """The resume step reaches TensorBoard as purge_step: the first attempt's points from the
    checkpoint's step on are dropped, so each step shows once, the resumed run's."""
    run_dir = tmp_path / "run"
    over: dict[str, Any] = {"eval": EVAL, "tracking": TRACK, "status": {"interval_s": 0.25}}
    first = write_config(tmp_path / "a.toml", tiny_assets, schedule={"max_steps": 20}, **over)
    assert run_cli(first, run_dir).returncode == 0
    before = _events(run_dir)
    more = write_config(tmp_path / "b.toml", tiny_assets, schedule={"max_steps": 40}, **over)
    out = run_cli(more, run_dir)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    after = _events(run_dir)[len(before) :]
    got = _tb_scalars(run_dir / "tb")
    kept = [e for e in before if getattr(e, "step", 0) < 20]
    _assert_same_series(got, _expected(kept + after))
    assert [s for s, _ in got["eval/tau"]] == [0, 10, 30, 40]
