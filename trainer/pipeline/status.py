"""What the run tells the outside: status lines, phase/checkpoint/error lines, run-state.json.

The `Reporter` prints every line to stdout (tmux) and appends it to RUN/status.log (what
dflashctl tails) and RUN/console.log. Status lines are built from a `Board` the drafter updates
after each step plus live queue depths, rolling-window rates and per-stage wait clocks, so a
starving stage is visible from the line alone (extra fields w_* and bottleneck).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

from trainer.events import (
    BOTTLENECK_KEY,
    BUCKET_LOSS_KEY,
    GNORM_KEY,
    LOSS_TYPE_KEY,
    TAU_KEY,
    TOKENS_KEY,
    StatusEvent,
    format_bucket_losses,
    format_checkpoint_line,
    format_error_line,
    format_phase_line,
    format_status_line,
)
from trainer.events.run_state import RUN_STATE_FILE, RunState
from trainer.pipeline.channels import WaitClock
from trainer.pipeline.launch_env import launch_rank, node_rank

WARNING_PREFIX = "WARNING: "  # a raw line to every reader: never the run's last error


class Reporter:
    """Line sink: stdout + status.log + console.log; silent on non-zero ranks."""

    def __init__(
        self, run_dir: Path, enabled: bool, stream: TextIO | None = None, rank: int | None = None
    ) -> None:
        self.enabled = enabled
        self.rank = rank  # named in a silent rank's ERROR line (its pane holds several ranks')
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()
        self._status = open(run_dir / "status.log", "a", buffering=1) if enabled else None  # noqa: SIM115
        self._console = open(run_dir / "console.log", "a", buffering=1) if enabled else None  # noqa: SIM115
        self._failed: set[TextIO] = set()
        self.last_error: str | None = None  # the last ERROR message this process printed

    def line(self, text: str, status_log: bool = True) -> None:
        if not self.enabled:
            return
        with self._lock:
            print(text, file=self.stream, flush=True)
            if status_log and self._status:
                self.append(self._status, text + "\n")
            if self._console:
                self.append(self._console, text + "\n")

    def append(self, fh: TextIO, text: str) -> None:
        """A log write that fails (full disk) must not take a stage down: say so once, go on."""
        try:
            fh.write(text)
        except OSError as exc:
            if fh not in self._failed:
                self._failed.add(fh)
                print(
                    format_error_line(f"cannot append to {fh.name}: {exc.strerror or exc}"),
                    file=self.stream,
                    flush=True,
                )
        else:
            self._failed.discard(fh)

    def phase(self, phase: str, detail: str = "") -> None:
        self.line(format_phase_line(phase, detail))

    def checkpoint(self, step: int, path: Path) -> None:
        self.line(format_checkpoint_line(step, str(path)))

    def warn(self, message: str) -> None:
        """One plain ``WARNING:`` line (a problem that does not stop the run and is not its
        error: ``last_error``, which dflashctl status shows, is left alone)."""
        self.line(WARNING_PREFIX + " ".join(message.split()))

    def error(self, message: str, tb: str | None = None) -> None:
        """Traceback to stderr and console.log, then one ERROR line everywhere. A rank without
        the run's files (not global rank 0) still prints its ERROR line and keeps it as
        `last_error`, which its node's run-state records: a node that refused says why."""
        if not self.enabled:
            if tb:
                print(tb, file=sys.stderr, end="" if tb.endswith("\n") else "\n", flush=True)
            if self.rank is not None:
                message = f"rank {self.rank}: {message}"
            self.last_error = message
            print(format_error_line(message), file=self.stream, flush=True)
            return
        if tb:
            with self._lock:
                print(tb, file=sys.stderr, end="" if tb.endswith("\n") else "\n", flush=True)
                if self._console:
                    self.append(self._console, tb)
        self.last_error = message
        self.line(format_error_line(message))

    def close(self) -> None:
        for fh in (self._status, self._console):
            if fh:
                with contextlib.suppress(OSError):  # a full disk fails the last flush
                    fh.close()


class RateWindow:
    """Rate of a monotone counter over the last `window_s` seconds (at least two samples)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque()

    def add(self, t: float, value: float) -> float | None:
        self._samples.append((t, value))
        while len(self._samples) > 2 and t - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        if len(self._samples) < 2:
            return None
        (t0, v0), (t1, v1) = self._samples[0], self._samples[-1]
        return (v1 - v0) / (t1 - t0) if t1 > t0 else None


@dataclass
class Board:
    """Drafter-side metrics, written after each optimizer step, read by the status monitor."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    step: int = 0
    micro: int = 0  # micro-batches consumed (= next sequence number)
    real_tokens: int = 0  # all ranks, since the run (not this process) started
    lr: float | None = None
    gnorm: float | None = None
    nonfinite: int = 0
    q_hs: list[int] = field(default_factory=list)  # reorder-buffer depth per rank (last step)
    sums: dict[str, float] = field(default_factory=dict)  # since the last status line
    last: dict[str, float | None] = field(default_factory=dict)  # last shown loss/acc/streak
    # (loss_sum, weight_sum) per length bucket since the last status line (finite steps only)
    bucket_sums: list[list[float]] = field(default_factory=list)

    def add_step(
        self,
        step: int,
        micro: int,
        real: int,
        lr: float,
        gnorm: float | None,
        sums: dict[str, float],
        bucket_sums: list[tuple[float, float]] | None = None,
    ) -> None:
        with self.lock:
            self.step, self.micro, self.real_tokens, self.lr = step, micro, real, lr
            if gnorm is not None:
                self.gnorm = gnorm
            for k, v in sums.items():
                self.sums[k] = self.sums.get(k, 0.0) + v
            for i, (loss_sum, weight) in enumerate(bucket_sums or ()):
                while len(self.bucket_sums) <= i:
                    self.bucket_sums.append([0.0, 0.0])
                self.bucket_sums[i][0] += loss_sum
                self.bucket_sums[i][1] += weight

    def state_dict(self) -> dict[str, int]:
        """The counters a checkpoint keeps (the rest restarts with the process)."""
        return {"nonfinite": self.nonfinite}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.nonfinite = int(state["nonfinite"])

    def take_bucket_losses(self, num_buckets: int) -> list[float | None]:
        """Mean loss per bucket over the steps since the last call (None: no batch of it)."""
        with self.lock:
            s, self.bucket_sums = self.bucket_sums, []
        out: list[float | None] = [None] * num_buckets
        for i, (loss_sum, weight) in enumerate(s[:num_buckets]):
            if weight > 0:
                out[i] = loss_sum / weight
        return out

    def take_metrics(self) -> dict[str, float | None]:
        """Loss/acc/streak over the steps since the last call (previous values if none)."""
        with self.lock:
            s, self.sums = self.sums, {}
            if s.get("weight_sum", 0) > 0:
                self.last["loss"] = s["loss_sum"] / s["weight_sum"]
            if s.get("n_pred", 0) > 0:
                self.last["acc"] = s["n_correct"] / s["n_pred"]
            if s.get("n_blocks", 0) > 0:
                self.last["streak"] = s["streak_sum"] / s["n_blocks"]
            return dict(self.last)


def wait_percent(
    clocks: list[WaitClock], attr: str, since: dict[tuple[int, str], float], dt: float
) -> float:
    """Mean percent of `dt` the given workers spent blocked (delta of their clocks)."""
    if not clocks or dt <= 0:
        return 0.0
    total = 0.0
    for c in clocks:
        now = c.total(attr)
        key = (id(c), attr)
        total += now - since.get(key, 0.0)
        since[key] = now
    return 100.0 * total / (len(clocks) * dt)


def bottleneck(w_tgt_in: float, w_tgt_out: float, w_dft_in: float) -> str:
    """Which stage limits throughput, from where the others wait."""
    if w_dft_in < 10.0:
        return "drafter"  # the drafter (almost) never waits: it is the slowest stage
    if w_tgt_in > 50.0:
        return "prefetch"  # targets wait for batches while the drafter waits for targets
    return "target"


def status_line(
    *,
    elapsed_s: float,
    board: Board,
    metrics: dict[str, float | None],
    noise: float,
    tgt_bps: float | None,
    dft_bps: float | None,
    ktok_s: float | None,
    q_pre: list[int],
    q_hs: list[int],
    epoch: float | None,
    eta_s: float | None,
    waits: dict[str, float] | None,
    tau: float | None = None,
    bucket_losses: list[float | None] | None = None,
    loss_type: str | None = None,
) -> str:
    """The status line. ``tau`` (the last eval's), ``loss_b`` and ``loss_type`` (which loss
    ``loss=`` is: `LossConfig.label()`) follow ``gnorm``; ``nonfinite`` (rare) comes last."""
    extra: dict[str, str] = {}
    if waits is not None:
        extra = {k: f"{v:.1f}%" for k, v in waits.items()}
        extra[BOTTLENECK_KEY] = bottleneck(waits["w_tgt_in"], waits["w_tgt_out"], waits["w_dft_in"])
    if board.gnorm is not None:
        extra[GNORM_KEY] = f"{board.gnorm:.3f}"
    if tau is not None:
        extra[TAU_KEY] = f"{tau:.3f}"
    if bucket_losses is not None:
        extra[BUCKET_LOSS_KEY] = format_bucket_losses(bucket_losses)
    if loss_type is not None:
        extra[LOSS_TYPE_KEY] = loss_type
    if board.step > 0:
        extra[TOKENS_KEY] = str(board.real_tokens)
    if board.nonfinite:
        extra["nonfinite"] = str(board.nonfinite)
    return format_status_line(
        StatusEvent(
            elapsed_min=int(elapsed_s // 60),
            step=board.step,
            loss=metrics.get("loss"),
            acc=metrics.get("acc"),
            streak=metrics.get("streak"),
            lr=board.lr,
            noise=noise,
            tgt_bps=tgt_bps,
            dft_bps=dft_bps,
            ktok_s=ktok_s,
            q_pre=q_pre,
            q_hs=q_hs,
            epoch=epoch,
            eta_s=eta_s,
            extra=extra,
        )
    )


RUN_STATE = RUN_STATE_FILE
_FIELDS = frozenset(RunState.model_fields)


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _read_state(path: Path) -> tuple[dict[str, object], str | None]:
    """The file's object and None, or ({}, why it is unusable) (missing is not a problem)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return {}, None
    except (OSError, UnicodeDecodeError) as exc:
        return {}, f"unreadable ({getattr(exc, 'strerror', None) or exc})"
    try:
        state = json.loads(text)
    except ValueError as exc:
        return {}, f"not JSON ({exc})"
    if not isinstance(state, dict):
        return {}, f"not a JSON object (a {type(state).__name__})"
    return state, None


def _write_state(path: Path, state: dict[str, object]) -> None:
    """Temp file + rename; on a full disk, rewrite in place (the old blocks are reused) rather
    than leave a stale `running` behind. Raises OSError only when both fail."""
    blob = json.dumps(state, indent=2, sort_keys=True) + "\n"
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        tmp.write_text(blob)
        os.replace(tmp, path)
        return
    except OSError:
        tmp.unlink(missing_ok=True)
    with open(path, "w") as fh:  # truncating frees the old blocks for the new text
        fh.write(blob)


class RunStateFile:
    """RUN/run-state.json as the trainer owns it (read by dflashctl status): the one writer of
    the `trainer.events.run_state.RunState` contract.

    Every update is checked against `RunState` first: a key the contract does not name, or a
    value of the wrong type, is a bug in the trainer and raises (ValueError) before anything
    is written. The trainer keeps every field it owns in memory and writes all of them each
    time, over what it finds on disk (keys other writers own, e.g. a supervisor's, are kept),
    so a file that was corrupted or truncated is rewritten whole by the next update. Each update
    returns the problems met (a corrupted file found, a write that failed) as one-line
    messages, for the caller to report; it never raises for those.
    """

    def __init__(self, run_dir: Path) -> None:
        self.path = run_dir / RUN_STATE
        self.owned: dict[str, object] = {}
        self._lock = threading.Lock()

    @staticmethod
    def check(fields: dict[str, object]) -> RunState:
        """`fields` as the contract reads them; ValueError naming a key it does not know."""
        unknown = sorted(set(fields) - _FIELDS)
        if unknown:
            raise ValueError(f"{RUN_STATE}: not a RunState field: {', '.join(unknown)}")
        return RunState.model_validate(fields)

    def heal(self) -> list[str]:
        """Rewrite the file whole if it is gone or no longer a JSON object (else one small read)."""
        _, why = _read_state(self.path)
        return self.update() if why or not self.path.exists() else []

    def update(self, **fields: object) -> list[str]:
        self.check(fields)
        problems: list[str] = []
        with self._lock:
            self.owned.update(fields)
            on_disk, why = _read_state(self.path)
            if why:
                problems.append(f"{self.path}: {why}; rewritten whole")
            state = {**on_disk, **self.owned, "updated_at": _now()}
            try:
                _write_state(self.path, state)
            except OSError as exc:
                problems.append(f"{self.path}: cannot write: {exc.strerror or exc}")
        return problems


# Node-level keys: written only on a multi-node run (a single-node run-state is unchanged).
NODE_ONLY = frozenset(
    {"node_rank", "nnodes", "rank_range", "step", "failed_rank", "peer_failure", "checkpoint_node"}
)
# What only the node that writes checkpoints can say (its run dir's paths, its newest step):
# always None in another node's run-state, whatever its own run dir holds.
WRITER_ONLY = frozenset(
    {"last_step", "last_checkpoint", "checkpoint_error", "checkpoint_failed", "best_checkpoint"}
)


@dataclass(frozen=True)
class NodeInfo:
    """Where this process sits in a multi-node torchrun launch (one torchrun agent per node).

    torchrun (2.13, `LocalElasticAgent`) exports GROUP_RANK = the agent's rank and
    GROUP_WORLD_SIZE = the number of agents (`--nnodes`). On a dflashctl group node the node's
    index is DFLASH_NODE_RANK, the inventory's order (c10d's GROUP_RANK is its sorting of
    addresses and pids, `distributed.launch_rank`); else GROUP_RANK (`--node-rank` under the
    static rendezvous). A node's ranks are the contiguous global ranks from node rank x
    LOCAL_WORLD_SIZE. Global rank 0, the one process that writes checkpoints, is on node 0."""

    node_rank: int
    nnodes: int
    rank_range: tuple[int, int]  # [first, last + 1) global ranks on this node
    checkpoint_node: int = 0  # the node whose run dir holds the run's checkpoints

    @property
    def writes_checkpoints(self) -> bool:
        return self.node_rank == self.checkpoint_node

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> NodeInfo | None:
        """This node's place, or None on a single-node (or non-torchrun) run."""
        env = dict(os.environ) if env is None else env
        nnodes = int(env.get("GROUP_WORLD_SIZE", "1"))
        if nnodes <= 1:
            return None
        first = launch_rank(env) - int(env.get("LOCAL_RANK", "0"))
        size = int(env.get("LOCAL_WORLD_SIZE", "1"))
        node = node_rank(env)
        return cls(int(env["GROUP_RANK"]) if node is None else node, nnodes, (first, first + size))

    def fields(self) -> dict[str, object]:
        return {
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "rank_range": list(self.rank_range),
            "checkpoint_node": self.checkpoint_node,
        }


class RunRecord:
    """The run's updates of run-state.json: written by each node's first local rank (global rank
    0 on a single node), and a corrupted file or a failed write is one ERROR line (training goes
    on). On a multi-node run (`node` set) every update carries the node's place, and `progress`
    and each status interval's `heal` write the node's step; without `node` the node-level
    keys are dropped, so a single-node run-state is what it always was. A node that does not
    write checkpoints records the `WRITER_ONLY` keys as None (`checkpoint_node` says where
    they are): its own run dir's checkpoints are not the run's, and it never learns the
    writer's paths."""

    def __init__(
        self,
        file: RunStateFile,
        reporter: Reporter,
        enabled: bool,
        node: NodeInfo | None = None,
    ) -> None:
        self.file, self.reporter, self.enabled, self.node = file, reporter, enabled, node
        self.step_of: Callable[[], int] | None = None  # the node's live step (for `heal`)
        self._placed = False

    def __call__(self, **fields: object) -> None:
        if not self.enabled:
            return
        if self.node is None:
            fields = {k: v for k, v in fields.items() if k not in NODE_ONLY}
        else:
            if not self.node.writes_checkpoints:
                fields = {k: None if k in WRITER_ONLY else v for k, v in fields.items()}
            if not self._placed:
                clear = {} if self.node.writes_checkpoints else dict.fromkeys(WRITER_ONLY)
                fields = {**self.node.fields(), **clear, **fields}
                self._placed = True
        for problem in self.file.update(**fields):
            self.reporter.error(problem)

    def progress(self, step: int) -> None:
        """The node's completed optimizer steps (multi-node runs only)."""
        if self.node is not None:
            self(step=step)

    def heal(self) -> None:
        """A corrupted run-state heals within a status line (and a node's step is current)."""
        if not self.enabled:
            return
        if self.node is not None and self.step_of is not None:
            self(step=self.step_of())  # a whole write, which heals as well
            return
        for problem in self.file.heal():
            self.reporter.error(problem)
