"""The run-state contract (RUN/run-state.json): what the trainer writes, dflashctl reads back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import get_args

import pytest

from trainer.events import EvalEvent, format_eval_line, parse_line
from trainer.events.run_state import (
    ENDED_PHASES,
    RUN_STATE_FILE,
    RunPhase,
    RunState,
    parse_run_state,
)

EVAL = EvalEvent(
    step=400, tau=3.214, loss=1.2345, acc=0.613, acc_at=[0.912, 0.801], tau_exp=3.368, best=400
)


def test_a_file_the_trainer_writes_parses_back(tmp_path: Path) -> None:
    from trainer.pipeline.status import RunStateFile

    file = RunStateFile(tmp_path)
    plan = {"total_steps": 1200, "end_step": 1200, "warmup_steps": 60, "boundaries": [1, 64, 512]}
    assert file.update(pid=4242, config_hash="abc123def456", state="running", **plan) == []
    assert file.update(last_eval=EVAL.model_dump(mode="json", exclude={"kind", "extra"})) == []
    assert file.update(state="finished", exit_status=0, last_step=1200) == []
    text = (tmp_path / RUN_STATE_FILE).read_text()
    state, problem = parse_run_state(text)
    assert problem is None
    assert (state.pid, state.config_hash, state.state, state.exit_status) == (
        4242,
        "abc123def456",
        "finished",
        0,
    )
    assert (state.total_steps, state.end_step, state.warmup_steps, state.boundaries) == (
        1200,
        1200,
        60,
        [1, 64, 512],
    )
    assert state.last_eval == EVAL and state.ended
    assert state.updated_at is not None  # the writer stamps every update


def test_a_state_with_an_eval_round_trips_through_json() -> None:
    state = RunState(state="running", total_steps=10, last_eval=EVAL, best_step=400)
    back, problem = parse_run_state(state.model_dump_json())
    assert problem is None and back == state
    assert isinstance(back.last_eval, EvalEvent)
    assert parse_line(format_eval_line(back.last_eval)) == EVAL  # the same event as its line


def test_unknown_keys_are_kept() -> None:
    """A newer trainer's field, or another writer's (a supervisor's), survives a read."""
    text = json.dumps({"state": "running", "supervisor": {"attempt": 2}, "ranks_up": 8})
    state, problem = parse_run_state(text)
    assert problem is None and state.state == "running"
    assert state.model_extra == {"supervisor": {"attempt": 2}, "ranks_up": 8}
    assert json.loads(state.model_dump_json())["supervisor"] == {"attempt": 2}


def test_no_file_yet_is_an_empty_state_without_a_problem() -> None:
    assert parse_run_state("") == (RunState(), None)
    assert parse_run_state(" \n") == (RunState(), None)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ('{"state": "running"', "run-state.json is corrupted: Expecting ',' delimiter (byte 19)"),
        ("[1, 2]", "run-state.json is corrupted: a JSON list, not an object"),
        ('{"total_steps": "many"}', "run-state.json is corrupted: key total_steps: "),
        ('{"state": "exploded"}', "run-state.json is corrupted: key state: "),
        ('{"warmup_steps": -1}', "run-state.json is corrupted: key warmup_steps: "),
        ('{"last_eval": {"step": -4}}', "run-state.json is corrupted: key last_eval.step: "),
        ('{"boundaries": [1, "x"]}', "run-state.json is corrupted: key boundaries.1: "),
    ],
)
def test_a_corrupted_or_invalid_file_is_one_line_naming_the_key(text: str, says: str) -> None:
    state, problem = parse_run_state(text)
    assert state == RunState()  # never a half-read state
    assert problem is not None and problem.startswith(says) and "\n" not in problem, problem


def test_the_problem_names_the_file_it_was_read_from() -> None:
    _, problem = parse_run_state("{", name="host-a:run/run-state.json")
    assert problem is not None and problem.startswith("host-a:run/run-state.json is corrupted: ")


def test_ended_is_true_for_every_final_phase_only() -> None:
    phases: tuple[str, ...] = get_args(RunPhase)
    assert set(ENDED_PHASES) < set(phases)
    for phase in phases:
        state = RunState.model_validate({"state": phase})
        assert state.ended == (phase in {"finished", "stopped", "refused", "crashed"}), phase
    assert not RunState().ended  # nothing written yet
