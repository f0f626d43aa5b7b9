"""Test-only fault injection and slow-down, driven by environment variables.

    DFLASH_FAULT=target:3          raise in the target worker on its 3rd batch
    DFLASH_STAGE_DELAY=target:0.05 sleep 50 ms per batch in every target worker (benchmarks)
    DFLASH_NONFINITE=5:2,10:100    make the loss NaN at optimizer steps 5-6 and 10-109
    DFLASH_INF_LR=11               run optimizer step 11 (0-based) with lr = inf, as a config
                                   with `lr = inf` did before validation refused it: every
                                   weight turns NaN/inf (tests the non-finite checkpoint guard)

Stages: prefetch, target, drafter, monitor. Never set these in production; they exist so the
tests can prove that a failure in any stage stops every stage and exits non-zero, and so the
benchmark can make a chosen stage the bottleneck on CPU.
"""

from __future__ import annotations

import os
import threading
import time

STAGES = ("prefetch", "target", "drafter", "monitor")


class InjectedFault(RuntimeError):
    """Raised by `maybe_fail`; only ever seen in tests."""


def _parse(var: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for part in os.environ.get(var, "").split(","):
        if ":" in part:
            stage, value = part.split(":", 1)
            out[stage.strip()] = value.strip()
    return out


class FaultPlan:
    """Per-stage fault counters and delays, read once from the environment."""

    def __init__(self) -> None:
        self.fail_at = {k: int(v) for k, v in _parse("DFLASH_FAULT").items()}
        self.delay = {k: float(v) for k, v in _parse("DFLASH_STAGE_DELAY").items()}
        self.nan_ranges = [(int(a), int(a) + int(n)) for a, n in _parse("DFLASH_NONFINITE").items()]
        raw = os.environ.get("DFLASH_INF_LR", "")
        self.inf_lr_steps = {int(x) for x in raw.split(",") if x.strip()}
        self._counts: dict[str, int] = {}
        self._lock = threading.Lock()

    def tick(self, stage: str) -> None:
        """Called once per item a stage handles: sleeps and/or raises as configured."""
        if stage in self.delay:
            time.sleep(self.delay[stage])
        if stage not in self.fail_at:
            return
        with self._lock:
            n = self._counts[stage] = self._counts.get(stage, 0) + 1
        if n == self.fail_at[stage]:
            raise InjectedFault(f"injected fault in stage {stage!r} at item {n} (DFLASH_FAULT)")

    def inf_lr_at(self, step: int) -> bool:
        """True when optimizer step `step` (0-based) should run with lr = inf."""
        return step in self.inf_lr_steps

    def nonfinite_at(self, step: int) -> bool:
        """True when the loss of optimizer step `step` (0-based) should be made NaN."""
        return any(lo <= step < hi for lo, hi in self.nan_ranges)
