"""A failed checkpoint as an event: an ERROR line of its own grammar, so every reader still sees
an `ErrorEvent` and the new ones read the step, the directory and the reason; run-state.json
keeps the last one (and how many failed in a row) until a write succeeds."""

from __future__ import annotations

from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from trainer.events import (
    EVENT_ADAPTER,
    CheckpointFailed,
    ErrorEvent,
    checkpoint_failed_message,
    format_error_line,
    format_line,
    parse_line,
)
from trainer.events.run_state import RUN_STATE_FILE, RunState, parse_run_state

FAILED = CheckpointFailed(
    step=15,
    directory="/w/run/checkpoints",
    reason="no space left (0.4 MiB free, checkpoint needs 1.2); kept step-00000010.pt",
)
LINE = (
    "ERROR: checkpoint step=15 not written to /w/run/checkpoints: no space left (0.4 MiB free, "
    "checkpoint needs 1.2); kept step-00000010.pt"
)


def test_the_line_is_an_error_that_names_step_directory_and_reason() -> None:
    assert format_error_line(checkpoint_failed_message(FAILED)) == LINE
    ev = parse_line(LINE)
    assert isinstance(ev, ErrorEvent) and ev.checkpoint_failed == FAILED
    assert ev.message == LINE.removeprefix("ERROR: ") and format_line(ev) == LINE
    again = EVENT_ADAPTER.validate_json(EVENT_ADAPTER.dump_json(ev))
    assert again == ev


def test_other_errors_carry_no_checkpoint() -> None:
    for message in ("stage drafter failed: boom", "checkpoint step=x not written to d: r"):
        ev = parse_line(format_error_line(message))
        assert isinstance(ev, ErrorEvent) and ev.checkpoint_failed is None


_WORD = st.text(st.characters(blacklist_categories=["Cc", "Cs", "Zs", "Zl", "Zp"]), min_size=1)
_WORDS = st.lists(_WORD, min_size=1).map(" ".join)  # error lines fold runs of whitespace


@given(
    step=st.integers(min_value=0, max_value=10**9),
    # a directory ends at the first ": " (the grammar's one ambiguity)
    directory=_WORDS.filter(lambda d: ": " not in d + " "),
    reason=_WORDS,
)
def test_round_trip(step: int, directory: str, reason: str) -> None:
    failed = CheckpointFailed(step=step, directory=directory, reason=reason)
    ev = parse_line(format_error_line(checkpoint_failed_message(failed)))
    assert isinstance(ev, ErrorEvent) and ev.checkpoint_failed == failed


def test_run_state_keeps_the_last_failure_until_a_write_succeeds(tmp_path: Path) -> None:
    from trainer.pipeline.status import RunStateFile

    file = RunStateFile(tmp_path)
    assert file.update(state="running", checkpoint_failed=None, checkpoint_failures=0) == []
    assert file.update(checkpoint_failed=FAILED.model_dump(), checkpoint_failures=2) == []
    state, problem = parse_run_state((tmp_path / RUN_STATE_FILE).read_text())
    assert problem is None and state.checkpoint_failed == FAILED
    assert state.checkpoint_failures == 2
    assert RunState().checkpoint_failed is None and RunState().checkpoint_failures == 0
