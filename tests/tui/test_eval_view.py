"""The "on track?" panes: held-out eval, the loss chart, per-bucket loss, GPU health.

Pure folds and renderers over the trainer's own printed lines (`eval_run_lines` goes through
`format_eval_line` / `format_status_line`), and Pilot tests over the app with its host screen.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from rich.text import Text
from textual.widgets import DataTable, Static

from dflashctl.gpus.nvidia_smi import GpuHealth, GpuSample, parse_gpu_csv, parse_health_csv
from dflashctl.monitor.evals import best_checkpoint, last_eval, tau_history
from dflashctl.monitor.follower import HostFollower
from dflashctl.monitor.state import HISTORY, RunState, apply_lines, apply_status, start_new_run
from dflashctl.tui.app import DflashApp, HostBinding
from dflashctl.tui.screens.fleet import tau_cell
from dflashctl.tui.screens.host import HostScreen
from dflashctl.tui.widgets.charts import LOSS_SMOOTHING, SMOOTHING_STEPS, debiased_ema
from dflashctl.tui.widgets.loss_plot import LossPlot, by_step
from dflashctl.tui.widgets.panes import bucket_loss_text, eval_text, gpus_text
from tests import budget
from tests.tui.fixtures import (
    BLOCK,
    FIXED_NOW,
    TAUS,
    WARMUP,
    ReplayControl,
    Status,
    bucket_losses,
    eval_event,
    eval_run_lines,
    seed_shape,
    service,
    status_line,
)
from trainer.events import EvalEvent, format_checkpoint_line, format_eval_line
from trainer.events import run_state as contract

SIZE = (120, 40)
H100 = Path(__file__).parents[1] / "ctl" / "fixtures" / "gpu-health" / "h100x8-driver550.csv"


async def _until(pilot, predicate: Callable[[], bool]) -> None:  # type: ignore[no-untyped-def]
    """Until `predicate` holds, the app running meanwhile, within the test's one budget."""
    await budget.until_async(predicate, pause=pilot.pause, every=0.02)


# ----------------------------------------------------------------------------- folds


def test_eval_lines_fold_into_the_tau_history_and_the_best() -> None:
    lines = eval_run_lines(48)  # evaluations after status lines 5, 10, ..., 45
    state = apply_lines(RunState("h"), lines, FIXED_NOW)
    assert [ev.step for ev in state.evals] == [150 * (n + 1) for n in range(9)]
    assert tau_history(state) == [(150 * (n + 1), TAUS[n]) for n in range(9)]
    newest = last_eval(state)
    assert newest is not None and newest.step == 1350 and len(newest.acc_at) == BLOCK - 1
    best = best_checkpoint(state)  # from the lines alone: the newest eval's best= and its tau
    assert best is not None and (best.step, best.tau, best.checkpoint) == (1350, 2.81, None)
    assert state.last_eval_at == FIXED_NOW
    # a fresh run starts its curves over
    fresh = start_new_run(state)
    assert fresh.evals == () and fresh.loss_points == () and fresh.bucket_loss_hist == ()
    assert last_eval(fresh) is None and best_checkpoint(fresh) is None


def test_the_trainers_run_state_names_the_best_checkpoint() -> None:
    state = apply_lines(RunState("h"), eval_run_lines(23), FIXED_NOW)  # 4 evals, best 600
    ahead = eval_event(5)  # the trainer evaluated again; the follow has not read that line yet
    info = contract.RunState(
        best_step=600,
        best_tau=2.61,
        best_checkpoint="run/checkpoints/step-00000600.pt",
        last_eval=ahead,
    )
    state = apply_status(state, Status(run_state=info))
    best = best_checkpoint(state)
    assert best is not None
    assert (best.step, best.tau, best.checkpoint) == (600, 2.61, info.best_checkpoint)
    assert last_eval(state) == ahead  # the newer one, from the poll
    assert tau_history(state)[-1] == (ahead.step, ahead.tau)
    text = eval_text(state, FIXED_NOW + 65, 40).plain
    assert "best  2.610 @ step 600" in text and "step-00000600.pt" in text
    assert f"eval  step {ahead.step}, 1m05s ago" in text


def test_no_eval_yet_says_so() -> None:
    state = apply_lines(RunState("h"), eval_run_lines(4), FIXED_NOW)
    assert state.evals == ()
    assert "no evaluation yet" in eval_text(state, FIXED_NOW, 40).plain


def test_eval_pane_marks_the_best_and_draws_acc_at_k_per_position() -> None:
    state = apply_lines(RunState("h"), eval_run_lines(23), FIXED_NOW - 5)
    text = eval_text(state, FIXED_NOW, 40)
    plain = text.plain.splitlines()
    assert plain[0].startswith("tau 2.610")  # the 4th evaluation's tau
    tau_row = next(line for line in plain if line.startswith("tau   "))
    acc_row = next(line for line in plain if line.startswith("acc@k "))
    # one bar per drafted position, falling with k (acc@k = 0.7 * 0.8^(k-1))
    bars = acc_row.removeprefix("acc@k ").split()
    assert len(bars) == BLOCK - 1 and bars[0][0] == "▆" and bars[-1][0] == "▁"
    assert "@1 0.70 … @7 0.18" in text.plain
    assert "best  2.610 @ step 600" in text.plain and "eval  step 600, 5s ago" in text.plain
    # the best evaluation's column (the 4th, the highest) is the highlighted one
    start = text.plain.index(tau_row) + len("tau   ")
    marked = [s for s in text.spans if s.style == "bold yellow reverse"]
    assert [(s.start - start, s.end - start) for s in marked] == [(3, 4)]


def test_bucket_losses_are_one_line_per_bucket_on_one_scale() -> None:
    lines = eval_run_lines(12)
    state = apply_lines(RunState("h"), lines, FIXED_NOW)
    assert len(state.bucket_loss_hist) == 11  # every status line after the first
    step, last = state.bucket_loss_hist[-1]
    assert step == 330 and last == tuple(bucket_losses(11))
    rows = bucket_loss_text(state, seed_shape(), 40).plain.splitlines()
    assert len(rows) == 6 and rows[0].lstrip().startswith("[0,770)")
    assert rows[5].lstrip().startswith("[3296,8192)")
    assert f"{bucket_losses(11)[0]:.3f}" in rows[0]
    assert "—" in rows[5]  # interval 11 had no batch from the longest bucket
    # no boundaries known: b0..b5
    unknown = bucket_loss_text(state, replace(seed_shape(), boundaries=None), 40).plain
    assert unknown.splitlines()[0].lstrip().startswith("b0")
    assert "no per-bucket loss yet" in bucket_loss_text(RunState("h"), seed_shape(), 40).plain


def test_a_malformed_loss_b_extra_is_ignored_not_fatal() -> None:
    lines = [status_line(3, loss_b="[1.0,oops]"), status_line(4, loss_b="[2.5,---]")]
    state = apply_lines(RunState("h"), lines, FIXED_NOW)
    assert state.bucket_loss_hist == ((120, (2.5, None)),)


# ----------------------------------------------------------------------------- smoothing


def test_debiased_ema_is_tensorboards_smoothing() -> None:
    values = [4.0, 2.0, 6.0, 3.0]
    w = 0.6
    # TensorBoard's own loop (tf_smoothing in its scalars dashboard)
    last, expected = 0.0, []
    for n, v in enumerate(values, 1):
        last = last * w + (1 - w) * v
        expected.append(last / (1 - w**n))
    assert debiased_ema(values, w) == pytest.approx(expected)
    assert debiased_ema(values, w)[0] == pytest.approx(4.0)  # no pull towards 0 at the start
    assert debiased_ema([5.0] * 10, 0.99) == pytest.approx([5.0] * 10)
    assert debiased_ema(values, 0.0) == values
    nan = debiased_ema([1.0, float("nan"), 3.0], 0.5)
    assert nan[1] != nan[1] and nan[2] == pytest.approx((0.5 * 0.5 + 0.5 * 3.0) / 0.75)
    with pytest.raises(ValueError):
        debiased_ema(values, 1.0)
    assert LOSS_SMOOTHING in SMOOTHING_STEPS


# ----------------------------------------------------------------------------- GPU health


def test_gpu_pane_shows_ecc_counts_and_throttle_reasons() -> None:
    health, errors = parse_health_csv(H100.read_text())
    assert not errors
    samples = "\n".join(
        f"{i}, NVIDIA H100 80GB HBM3, 97, 71000, 81559, 70, 650.0" for i in range(8)
    )
    state = replace(RunState("h"), gpus=tuple(parse_gpu_csv(samples)), gpu_health=tuple(health))
    text = gpus_text(state)
    lines = text.plain.splitlines()
    # each GPU's sample line; a health line under the three with something to say (GPU2:
    # corrected ECC, GPU4: HW slowdown, GPU5: uncorrected ECC); one line for the other five
    assert len(lines) == 8 + 3 + 1
    gpu2, gpu4, gpu5 = lines[3], lines[6], lines[8]
    assert lines[2].startswith("GPU2") and "ECC 2 corr / 0 uncorr  gpu_idle" in gpu2
    assert "hw_slowdown" in gpu4 and "hw_thermal_slowdown" in gpu4  # 0x48
    assert "ECC 14 corr / 1 uncorr (3 ever)" in gpu5 and "sw_power_cap" in gpu5
    assert lines[-1] == "GPUs 0,1,3,6,7: ECC 0 errors, no HW throttle"
    red = {text.plain[s.start : s.end] for s in text.spans if s.style == "bold red"}
    assert {"hw_slowdown", "hw_thermal_slowdown", "1 uncorr"} <= red
    assert "sw_power_cap" not in red  # normal under a training load
    # a GPU without health data shows its sample line only
    assert len(gpus_text(replace(state, gpu_health=())).plain.splitlines()) == 8


class HealthControl(ReplayControl):
    """A control that also reports GPU health (what `monitor.HealthSource` asks for)."""

    async def gpus(self) -> list[GpuSample]:
        return parse_gpu_csv("0, NVIDIA H100 80GB HBM3, 97, 71000, 81559, 70, 650.0\n")

    async def gpu_health(self) -> Sequence[GpuHealth]:
        return parse_health_csv(H100.read_text())[0][:1]


async def test_the_follower_polls_gpu_health_where_the_control_reports_it() -> None:
    follower = HostFollower("h", HealthControl(), lambda s: None)
    await follower.poll_gpus()
    assert [h.index for h in follower.state.gpu_health] == [0]
    plain = ReplayControl()  # no gpu_health, no GPUs: nothing asked, nothing shown
    other = HostFollower("h", plain, lambda s: None)
    await other.poll_gpus()
    assert other.state.gpu_health == () and other.state.gpus == ()


# ----------------------------------------------------------------------------- Pilot


def _app() -> DflashApp:
    return DflashApp(
        [HostBinding("kpro6", service(), shape=seed_shape())], clock=lambda: FIXED_NOW, live=False
    )


async def test_a_new_eval_line_updates_the_eval_pane() -> None:
    app = _app()
    async with app.run_test(size=SIZE) as pilot:
        app.feed("kpro6", eval_run_lines(23), now=FIXED_NOW - 30)
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen) and app.screen.painted)
        pane = app.screen.query_one("#eval", Static)
        assert "tau 2.610" in str(pane.content) and "eval  step 600, 30s ago" in str(pane.content)
        new = EvalEvent(step=750, tau=2.93, loss=4.1, acc=0.9, acc_at=[0.9, 0.7], best=750)
        app.feed("kpro6", [format_eval_line(new)], now=FIXED_NOW)
        await _until(pilot, lambda: "tau 2.930" in str(pane.content))
        shown = str(pane.content)
        assert "best  2.930 @ step 750" in shown and "eval  step 750, 0s ago" in shown
        assert "@1 0.90 … @2 0.70" in shown


async def test_loss_plot_replots_only_when_its_data_changed() -> None:
    app = _app()
    async with app.run_test(size=SIZE) as pilot:
        app.feed("kpro6", eval_run_lines(30), now=FIXED_NOW)
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen) and app.screen.painted)
        plot = app.screen.query_one("#loss-plot", LossPlot)
        replots = plot.replots
        assert replots >= 1
        assert plot.border_subtitle == f"in warmup until step {WARMUP} (24%)"
        for _ in range(5):  # ticks with nothing new: no replot
            app.flush()
        ckpt = format_checkpoint_line(900, "run/checkpoints/step-00000900.pt")
        app.feed("kpro6", [ckpt])
        app.flush()  # a line without a loss: the plot's data did not change
        assert plot.replots == replots
        app.feed("kpro6", [status_line(30)])
        app.flush()
        assert plot.replots == replots + 1
        before = plot.smoothing
        await pilot.press("m")  # the smoothing key cycles the EMA weight and replots
        await _until(pilot, lambda: plot.replots == replots + 2)
        assert plot.smoothing != before and plot.smoothing in SMOOTHING_STEPS
        assert plot.smoothing == SMOOTHING_STEPS[SMOOTHING_STEPS.index(before) + 1]
        assert f"EMA {plot.smoothing:g} debiased" in str(plot.border_title)


def test_history_is_bounded() -> None:
    state = apply_lines(RunState("h"), eval_run_lines(HISTORY + 40, every=1), FIXED_NOW)
    assert len(state.evals) == HISTORY and len(state.loss_points) == HISTORY
    assert len(state.bucket_loss_hist) == HISTORY


async def test_loss_plot_marks_the_end_of_warmup_inside_the_plotted_steps() -> None:
    app = _app()
    async with app.run_test(size=SIZE) as pilot:
        app.feed("kpro6", eval_run_lines(30), now=FIXED_NOW)
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen) and app.screen.painted)
        plot = app.screen.query_one("#loss-plot", LossPlot)
        points = app.states["kpro6"].loss_points
        assert plot.show(points, warmup=450)  # a different warmup: replotted
        assert not plot.show(points, warmup=450)
        assert plot.border_subtitle == ""
        assert "warmup end" in plot.plt.uncolorize(plot.plt.build())
        assert plot.show(points, warmup=None)
        assert "warmup end" not in plot.plt.uncolorize(plot.plt.build())


def test_a_resume_replots_the_steps_it_repeats_once() -> None:
    """A resume from step 60 prints steps 90.. again: the chart keeps the continuing run's."""
    first = [(30, 5.0), (60, 4.8), (90, 4.7), (120, 4.9)]
    resumed = [(90, 4.6), (120, 4.5), (150, 4.4)]
    assert by_step(first + resumed) == ([30, 60, 90, 120, 150], [5.0, 4.8, 4.6, 4.5, 4.4])


async def test_the_eval_age_ticks_without_a_new_line() -> None:
    """No line arrives and nothing is read from the host: the pane's "N ago" still follows the
    app's clock (the pane's own timer), and the fleet row shows the last eval's tau, marked
    while it is the best."""
    now = [FIXED_NOW]
    app = DflashApp(
        [HostBinding("kpro6", service(), shape=seed_shape())], clock=lambda: now[0], live=False
    )
    async with app.run_test(size=SIZE) as pilot:
        app.feed("kpro6", eval_run_lines(23), now=FIXED_NOW - 30)  # the last eval: step 600
        table = app.screen.query_one("#fleet", DataTable)
        await _until(pilot, lambda: str(table.get_cell("kpro6", "tau")) == "2.61*")
        await pilot.press("enter")
        await _until(pilot, lambda: isinstance(app.screen, HostScreen) and app.screen.painted)
        pane = app.screen.query_one("#eval", Static)
        assert "eval  step 600, 30s ago" in str(pane.content)
        before = app.states["kpro6"]
        now[0] = FIXED_NOW + 95
        await _until(pilot, lambda: "eval  step 600, 2m05s ago" in str(pane.content))
        assert app.states["kpro6"] is before  # no new state: the pane's own timer redrew it
        lower = EvalEvent(step=750, tau=2.2, loss=4.3, acc=0.8, acc_at=[0.8], best=600)
        app.feed("kpro6", [format_eval_line(lower)])
        await pilot.press("escape")
        fleet = app.screen.query_one("#fleet", DataTable)
        await _until(pilot, lambda: str(fleet.get_cell("kpro6", "tau")) == "2.20")  # below best


def test_the_fleet_tau_cell_is_the_last_eval_with_the_best_marked() -> None:
    assert tau_cell(RunState("h")) == "—"  # no eval yet
    state = apply_lines(RunState("h"), eval_run_lines(23), FIXED_NOW)  # 4 evals, best the last
    best = tau_cell(state)
    assert isinstance(best, Text) and (best.plain, best.style) == ("2.61*", "bold yellow")
    info = contract.RunState(best_step=300, best_tau=2.9)  # the trainer's best: an earlier one
    assert tau_cell(apply_status(state, Status(run_state=info))) == "2.61"
    ahead = eval_event(5)  # run-state.json's last eval, newer than the lines read
    polled = apply_status(state, Status(run_state=contract.RunState(last_eval=ahead)))
    shown = best_checkpoint(polled)
    mark = "*" if shown is not None and shown.step == ahead.step else ""
    assert str(tau_cell(polled)) == f"{ahead.tau:.2f}{mark}"
