"""The supervisor's pure pieces on their own: restart counting in the window, the argv split."""

from __future__ import annotations

from trainer.config.policy import Policy
from trainer.supervision.flags import split_argv
from trainer.supervision.restarts import GiveUp, NextRestart, RestartHistory


def test_restarts_within_the_window_are_counted_and_then_given_up() -> None:
    history = RestartHistory(Policy(max_restarts=2, restart_window_s=100.0, backoff_s=1.0))
    first = history.plan(0.0, "exit 1")
    assert first == NextRestart(1, 1.0)
    history.add(0.0, attempt=2, why="exit 1", returncode=-9, checkpoint_step=None, wait=1.0)
    assert history.records[-1]["signal"] == "SIGKILL" and history.records[-1]["attempt"] == 2
    second = history.plan(10.0, "stall")
    assert isinstance(second, NextRestart) and second.number == 2 and second.wait >= first.wait
    history.add(10.0, attempt=3, why="stall", returncode=1, checkpoint_step=5, wait=second.wait)
    assert history.resumed(5) and history.records[-1]["resumed_step"] == 5
    assert history.plan(20.0, "exit 3") == GiveUp("after 2 restarts in 20 s: exit 1, stall, exit 3")
    # past the window the old restarts no longer count
    assert history.plan(500.0, "exit 1") == NextRestart(1, 1.0)


def test_no_restart_to_resume_records_nothing() -> None:
    assert not RestartHistory(Policy()).resumed(3)


def test_the_trainer_argv_is_what_follows_the_first_double_dash() -> None:
    assert split_argv(["--restart", "never", "--", "py", "--", "x"]) == (
        ["--restart", "never"],
        ["py", "--", "x"],
    )
    assert split_argv(["--restart", "never"]) == (["--restart", "never"], [])


def test_a_regeneration_child_restarts_with_resume_and_its_status_lines_are_progress() -> None:
    from trainer.config.policy import regen_restart_argv
    from trainer.events import RegenEvent, format_regen_line
    from trainer.supervision.progress import Progress

    argv = ["py", "-m", "trainer.regen", "--out", "o.jsonl"]
    assert regen_restart_argv(argv) == [*argv, "--resume"]
    assert regen_restart_argv([*argv, "--resume"]) == [*argv, "--resume"]
    progress = Progress(0.0)
    line = format_regen_line(RegenEvent(elapsed_min=0, finished=0, total=9, errors=0, length=0))
    progress.feed_lines([line], 5.0)
    assert progress.trained and progress.last_progress == 5.0
