"""The supervisor's `state_stale` line: what it is while RUN/supervisor.json cannot be written,
in one grammar shared with the pane's readers."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from trainer.events import PhaseEvent, StaleState, format_state_stale, parse_line, parse_state_stale

_WORD = st.text(st.characters(blacklist_categories=["Cc", "Cs", "Zs", "Zl", "Zp"]), min_size=1)
_WORDS = st.lists(_WORD, min_size=1).map(" ".join)


def test_the_line_names_the_file_why_and_the_supervisor_s_state() -> None:
    stale = StaleState(
        path="/w/run/supervisor.json",
        why="No space left on device: the disk is full",
        state="gave-up",
        attempt=4,
        exit_status=1,
        detail="gave up after 3 restarts",
    )
    line = format_state_stale(stale)
    assert line == (
        "Supervisor state file stale: /w/run/supervisor.json not written (No space left on "
        "device: the disk is full), it is out of date: the supervisor is gave-up, attempt 4, "
        "exit status 1; gave up after 3 restarts"
    )
    ev = parse_line(line)
    assert isinstance(ev, PhaseEvent) and ev.phase == "state_stale"
    assert parse_state_stale(ev.detail) == stale
    running = stale.model_copy(update={"state": "running", "exit_status": None, "detail": ""})
    line = format_state_stale(running)
    assert line.endswith("the supervisor is running, attempt 4, exit status ---")
    assert parse_state_stale(parse_line(line + "\n").detail) == running  # type: ignore[union-attr]
    assert parse_state_stale("something else") is None


@given(
    path=_WORDS.filter(lambda p: " not written (" not in p),
    why=_WORDS.filter(lambda w: "), it is out of date: " not in w),
    state=_WORD,
    attempt=st.integers(min_value=0, max_value=10**6),
    exit_status=st.none() | st.integers(min_value=0, max_value=255),
    detail=st.just("") | _WORDS,
)
def test_round_trip(
    path: str, why: str, state: str, attempt: int, exit_status: int | None, detail: str
) -> None:
    stale = StaleState(
        path=path, why=why, state=state, attempt=attempt, exit_status=exit_status, detail=detail
    )
    ev = parse_line(format_state_stale(stale))
    assert isinstance(ev, PhaseEvent) and parse_state_stale(ev.detail) == stale
