"""Restart bookkeeping: the failures and restarts within the policy's window, the give-up once
`max_restarts` are spent there, the number and backoff of the next restart, and each restart's
record in supervisor.json (`restarts`, the same list the state holds).
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from trainer.config.policy import Policy
from trainer.supervision.statefile import now_iso


@dataclass(frozen=True)
class NextRestart:
    number: int  # 1-based, among the restarts within the window
    wait: float  # the backoff before it, seconds


@dataclass(frozen=True)
class GiveUp:
    detail: str  # `after N restarts in S s: reason, reason, ...`


class RestartHistory:
    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.records: list[dict[str, Any]] = []
        self._failures: list[tuple[float, str]] = []  # (monotonic time, reason) of every failure
        self._restart_times: list[float] = []  # monotonic time of each restart

    def plan(self, now: float, why: str) -> NextRestart | GiveUp:
        """Count a failure at `now`: the restart it gets, or the give-up when none is left."""
        self._failures.append((now, why))
        window = self.policy.restart_window_s
        recent = [t for t in self._restart_times if now - t <= window]
        if len(recent) >= self.policy.max_restarts:
            counted = [f for f in self._failures if now - f[0] <= window]
            span = now - counted[0][0] if len(counted) > 1 else 0.0
            return GiveUp(
                f"after {len(recent)} restarts in {span:.0f} s: " + ", ".join(r for _, r in counted)
            )
        number = len(recent) + 1
        return NextRestart(number, self.policy.backoff(number))

    def add(
        self,
        now: float,
        *,
        attempt: int,
        why: str,
        returncode: int,
        checkpoint_step: int | None,
        wait: float,
    ) -> None:
        """Record the restart planned at `now` (attempt: the one it starts)."""
        self.records.append(
            {
                "at": now_iso(),
                "attempt": attempt,
                "reason": why,
                "exit_status": returncode,
                "signal": signal.Signals(-returncode).name if returncode < 0 else None,
                "checkpoint_step": checkpoint_step,
                "resumed_step": None,
                "backoff_s": wait,
            }
        )
        self._restart_times.append(now)

    def resumed(self, step: int) -> bool:
        """Note the step the last restart resumed from; False when there was no restart."""
        if not self.records:
            return False
        self.records[-1]["resumed_step"] = step
        return True
