"""When the run's own files cannot be written (a full disk): what the pane says instead (pure).

The supervisor rewrites RUN/supervisor.json and the trainer RUN/run-state.json and status.log;
on a full disk those go on saying an older state while the pane (tmux keeps it in memory) has
the truth. These rules read it back so status never reports a state the run has left:
- `stale_supervisor`: the supervisor's `state_stale` line (trainer.events `StaleState`) wins
  over the file it could not write, and says so (`note`);
- `newest_status`: the later of status.log's and the pane's last status line;
- `checkpoint_failure`: the newest checkpoint the trainer could not write, from run-state.json,
  status.log or the pane, unless a later checkpoint was written.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.events import (
    CheckpointEvent,
    CheckpointFailed,
    ErrorEvent,
    Event,
    PhaseEvent,
    StaleState,
    StatusEvent,
    parse_state_stale,
)
from trainer.events.run_state import RunState

STALE_PHASE = "state_stale"


def stale_state(pane_events: Sequence[Event]) -> StaleState | None:
    """The supervisor's last `state_stale` line on the pane, or None."""
    for e in reversed(pane_events):
        if isinstance(e, PhaseEvent) and e.phase == STALE_PHASE:
            stale = parse_state_stale(e.detail)
            if stale is not None:
                return stale
    return None


def stale_supervisor(fields: dict[str, object], stale: StaleState) -> dict[str, object]:
    """supervisor.json's fields with the pane's truth laid over the ones it could not update."""
    truth: dict[str, object] = {"state": stale.state, "attempt": stale.attempt}
    if stale.exit_status is not None:
        truth["exit_status"] = stale.exit_status
    if stale.detail:
        truth["detail"] = stale.detail
    return {**fields, **truth}


def stale_note(stale: StaleState) -> str:
    """`run/supervisor.json is out of date: not written (No space left on device: the disk is
    full); its state is read from the pane`."""
    return (
        f"{stale.path} is out of date: not written ({stale.why}); the supervisor's state is "
        f"read from its pane"
    )


def newest_status(*sources: Sequence[Event]) -> StatusEvent | None:
    """Of each source's last status line (status.log's, the pane's), the one with the higher
    step; the earlier source wins a tie. On a full disk status.log stops while the pane goes
    on; after a supervised restart both end with the new attempt's lines."""
    best: StatusEvent | None = None
    for events in sources:
        last = next((e for e in reversed(events) if isinstance(e, StatusEvent)), None)
        if last is not None and (best is None or last.step > best.step):
            best = last
    return best


def checkpoint_failure(
    run_state: RunState, events: Sequence[Event], last_written: CheckpointEvent | None
) -> CheckpointFailed | None:
    """The newest checkpoint not written (run-state.json or an error line), unless a
    checkpoint of a later step was written since (the trainer clears it then too)."""
    found = [run_state.checkpoint_failed] if run_state.checkpoint_failed else []
    found += [
        e.checkpoint_failed for e in events if isinstance(e, ErrorEvent) and e.checkpoint_failed
    ]
    if not found:
        return None
    newest = max(found, key=lambda f: f.step)
    if last_written is not None and last_written.step > newest.step:
        return None
    return newest
