"""RUN/run-state.json: what the trainer knows about its run, as one typed contract.

The trainer is the only writer (`trainer.pipeline.status.RunStateFile`); dflashctl is the only
reader (`parse_run_state`). Everything the operator's side shows about a run's plan (total
steps, end step, warmup, bucket boundaries) comes from here: the laptop never re-derives what
the trainer already decided.

Unknown keys are kept (`extra="allow"`): a newer trainer may write fields an older dflashctl
does not know, and other writers' keys survive the trainer's rewrites. Torch-free on purpose:
dflashctl imports it on laptops.
"""

from __future__ import annotations

import json
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.events.escapes import sanitize_for_terminal
from trainer.events.evaluation import EvalEvent
from trainer.events.lifecycle import CheckpointFailed

RUN_STATE_FILE = "run-state.json"

# starting -> running -> finished (the whole plan) | stopped (a signal, every step kept) |
# crashed (a failure, or a signal that lost steps) | refused (a usage error before training)
RunPhase = Literal["starting", "running", "finished", "stopped", "refused", "crashed"]
ENDED_PHASES: frozenset[str] = frozenset({"finished", "stopped", "refused", "crashed"})


class RunState(BaseModel):
    """One run's RUN/run-state.json. Every field is optional: a run that has just started has
    written only some of them, and an old file may lack the newer ones."""

    model_config = ConfigDict(extra="allow")

    # who and what
    pid: int | None = None
    # the trainer's parent: the supervisor, or a launcher (torchrun) between them; lets the
    # supervisor recognise rank 0's record when its own child is torchrun
    parent_pid: int | None = None
    config_hash: str | None = None
    release: str | None = None
    world_size: int | None = Field(default=None, ge=1)
    started_at: str | None = None
    updated_at: str | None = None
    state: RunPhase | None = None
    exit_status: int | None = None
    # the plan, as the trainer computed it
    total_steps: int | None = Field(default=None, ge=0)
    end_step: int | None = Field(default=None, ge=0)
    warmup_steps: int | None = Field(default=None, ge=0)
    boundaries: list[int] | None = None
    # checkpoints: written by the node whose run dir holds them (a single-node run's, a
    # multi-node run's node 0: `checkpoint_node`); None in every other node's run-state
    last_step: int | None = Field(default=None, ge=0)  # the newest checkpoint's step
    last_checkpoint: str | None = None  # its path, on the node that wrote it
    checkpoint_error: str | None = None  # the last failed write's message, until one succeeds
    # the last failed write (step, directory, reason) and how many failed in a row; None and 0
    # once one succeeds. The trainer stops (exit 3) when writes keep failing (runner).
    checkpoint_failed: CheckpointFailed | None = None
    checkpoint_failures: int = Field(default=0, ge=0)
    # how it stopped
    stop_signal: str | None = None
    signals: int = Field(default=0, ge=0)
    stop_detail: str | None = None
    lost_steps: int = Field(default=0, ge=0)
    last_error: str | None = None
    # multi-node runs: every node's first local rank writes its own node's RUN/run-state.json
    # (node 0's is the run's, with everything above); absent on a single-node run. Ranks are
    # torchrun's global ranks (RANK, what its logs and failure reports name): in an M:N run
    # (`topology.targets = "shared"`) they count target processes too, not only drafters. On
    # a dflashctl group node they are in the inventory's node order (DFLASH_NODE_RANK), which
    # c10d's numbering of the agents need not be.
    node_rank: int | None = Field(default=None, ge=0)
    nnodes: int | None = Field(default=None, ge=1)
    rank_range: list[int] | None = None  # [first, last + 1) global ranks on this node
    step: int | None = Field(default=None, ge=0)  # optimizer steps this node has completed
    # the global rank (as in rank_range) that failed first, if known: the first process that
    # failed by itself publishes it, its peers read it; None when it was killed outright
    failed_rank: int | None = Field(default=None, ge=0)
    # this rank failed because another went away (its collective broke), not by itself
    peer_failure: bool | None = None
    checkpoint_node: int | None = Field(default=None, ge=0)  # whose run dir has the checkpoints
    # held-out evaluation
    holdout_rows: int | None = Field(default=None, ge=0)
    holdout_sha256: str | None = None
    eval_rows: int | None = Field(default=None, ge=0)
    eval_seconds: float | None = None
    eval_share: float | None = None
    last_eval: EvalEvent | None = None
    best_step: int | None = Field(default=None, ge=0)
    best_tau: float | None = None
    best_checkpoint: str | None = None

    @property
    def checkpoints_elsewhere(self) -> int | None:
        """The node holding this run's checkpoints when it is not this one (another node of a
        multi-node run: its own checkpoint keys are None), else None."""
        node, writer = self.node_rank, self.checkpoint_node
        return writer if node is not None and writer is not None and node != writer else None

    @property
    def ended(self) -> bool:
        """The trainer recorded how it ended (finished, stopped, refused or crashed)."""
        return self.state in ENDED_PHASES


JsonValue = str | int | float | bool | None | list["JsonValue"] | dict[str, "JsonValue"]


def _printable(value: object) -> JsonValue:
    """Parsed JSON with every string (keys too) made safe to print: the file comes from a host."""
    if isinstance(value, str):
        return sanitize_for_terminal(value)
    if isinstance(value, list):
        return [_printable(v) for v in value]
    if isinstance(value, dict):
        return {sanitize_for_terminal(str(k)): _printable(v) for k, v in value.items()}
    if value is None or isinstance(value, int | float | bool):
        return value
    return str(value)  # json.loads makes nothing else


def read_json_object(text: str, name: str) -> tuple[dict[str, JsonValue] | None, str | None]:
    """A JSON object file's text -> (its fields, strings safe to print, None); no text -> (None,
    None); anything else -> (None, one line saying why), never silently empty."""
    if not text.strip():
        return None, None
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as err:
        return None, f"{name} is corrupted: {err.msg} (byte {err.pos})"
    if not isinstance(raw, dict):
        return None, f"{name} is corrupted: a JSON {type(raw).__name__}, not an object"
    return {sanitize_for_terminal(str(k)): _printable(v) for k, v in raw.items()}, None


def parse_run_state(text: str, name: str = RUN_STATE_FILE) -> tuple[RunState, str | None]:
    """The one reader: the file's text -> (state, None); empty text (no file yet) ->
    (RunState(), None); a corrupted or invalid file -> (RunState(), one line naming the file
    and the key), never a half-read state. Strings are made safe to print before validation."""
    raw, error = read_json_object(text, name)
    if raw is None:
        return RunState(), error
    try:
        return RunState.model_validate(raw), None
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        return RunState(), f"{name} is corrupted: key {where}: {err['msg']}"
