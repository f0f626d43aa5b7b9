"""What the run tells the outside: status lines, phase/checkpoint/error lines, run-state.json.

The `Reporter` prints every line to stdout (tmux) and appends it to RUN/status.log (what
dflashctl tails) and RUN/console.log. Status lines are built from a `Board` the drafter updates
after each step plus live queue depths, rolling-window rates and per-stage wait clocks, so a
starving stage is visible from the line alone (extra fields w_* and bottleneck).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from trainer.events import (
    BOTTLENECK_KEY,
    GNORM_KEY,
    StatusEvent,
    format_checkpoint_line,
    format_error_line,
    format_phase_line,
    format_status_line,
)
from trainer.pipeline.channels import WaitClock


class Reporter:
    """Line sink: stdout + status.log + console.log; silent on non-zero ranks."""

    def __init__(self, run_dir: Path, enabled: bool, stream: TextIO | None = None) -> None:
        self.enabled = enabled
        self.stream = stream or sys.stdout
        self._lock = threading.Lock()
        self._status = open(run_dir / "status.log", "a", buffering=1) if enabled else None  # noqa: SIM115
        self._console = open(run_dir / "console.log", "a", buffering=1) if enabled else None  # noqa: SIM115

    def line(self, text: str, status_log: bool = True) -> None:
        if not self.enabled:
            return
        with self._lock:
            print(text, file=self.stream, flush=True)
            if status_log and self._status:
                self._status.write(text + "\n")
            if self._console:
                self._console.write(text + "\n")

    def phase(self, phase: str, detail: str = "") -> None:
        self.line(format_phase_line(phase, detail))

    def checkpoint(self, step: int, path: Path) -> None:
        self.line(format_checkpoint_line(step, str(path)))

    def error(self, message: str, tb: str | None = None) -> None:
        """Traceback to stderr and console.log, then one ERROR line everywhere."""
        if not self.enabled:
            print(tb or message, file=sys.stderr, flush=True)
            return
        if tb:
            with self._lock:
                print(tb, file=sys.stderr, end="" if tb.endswith("\n") else "\n", flush=True)
                if self._console:
                    self._console.write(tb)
        self.line(format_error_line(message))

    def close(self) -> None:
        for fh in (self._status, self._console):
            if fh:
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

    def add_step(
        self,
        step: int,
        micro: int,
        real: int,
        lr: float,
        gnorm: float | None,
        sums: dict[str, float],
    ) -> None:
        with self.lock:
            self.step, self.micro, self.real_tokens, self.lr = step, micro, real, lr
            if gnorm is not None:
                self.gnorm = gnorm
            for k, v in sums.items():
                self.sums[k] = self.sums.get(k, 0.0) + v

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
) -> str:
    extra: dict[str, str] = {}
    if waits is not None:
        extra = {k: f"{v:.1f}%" for k, v in waits.items()}
        extra[BOTTLENECK_KEY] = bottleneck(waits["w_tgt_in"], waits["w_tgt_out"], waits["w_dft_in"])
    if board.gnorm is not None:
        extra[GNORM_KEY] = f"{board.gnorm:.3f}"
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


def write_run_state(run_dir: Path, **fields: Any) -> None:
    """Atomically merge `fields` into RUN/run-state.json (read by dflashctl status)."""
    path = run_dir / "run-state.json"
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        state = {}
    state.update(fields)
    state["updated_at"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    tmp = path.with_name(f".run-state.json.{os.getpid()}")
    tmp.write_text(json.dumps(state, indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)
