"""A group node's supervisor.json: its state, the failures seen on this node and the group
restarts this node counted, each with the group's attempt (the rendezvous round) it belongs to,
so dflashctl can put the nodes' records side by side and name the node and rank that failed
first in each attempt.
"""

from __future__ import annotations

import json
import os
from typing import Any

from trainer.config.policy import Policy
from trainer.events import format_phase_line
from trainer.supervision.agent import WorkerFailed
from trainer.supervision.console import Console
from trainer.supervision.group import (
    AgentLife,
    GroupNode,
    failure_record,
    signal_reason,
    worker_no_restart,
)
from trainer.supervision.statefile import StateFile, now_iso

KEEP_FAILURES = 50  # the newest failures kept in supervisor.json


class GroupRecord:
    def __init__(self, node: GroupNode, policy: Policy, argv: list[str], file: StateFile) -> None:
        self.node, self.policy, self.file = node, policy, file
        self.attempt = 0  # rendezvous rounds completed: the group's attempt number
        self.failures: list[dict[str, Any]] = []
        self.restarts: list[dict[str, Any]] = []
        self.wrote_checkpoint = False
        self._first: dict[str, Any] | None = None  # this node's first failure since the round
        self._killed: set[int] = set()  # ranks the watchdog killed (recorded as the stall)
        self.state: dict[str, Any] = {
            "pid": os.getpid(),
            "started_at": now_iso(),
            "policy": policy.as_json(),
            "argv": argv,
            "state": "starting",
            "attempt": 0,
            "trainer_pid": None,
            "agent_pid": None,
            "group": node.as_json(),
            "group_rank": None,  # c10d's rank of this node's agent in the current round
            "restarts": self.restarts,
            "failures": self.failures,
            "gave_up": False,
            "detail": None,
            "exit_status": None,
            "low_disk": None,
            "low_disks": [],
        }

    def save(self, **fields: Any) -> None:
        self.state.update(fields)
        del self.failures[:-KEEP_FAILURES]
        self.file.write(self.state)

    # ------------------------------------------------------------------ the agent's phases
    def agent_started(self, pid: int) -> None:
        self.save(state="rendezvous", agent_pid=pid, detail=self._waiting())

    def rendezvous(self) -> None:
        self.save(state="rendezvous", detail=self._waiting())

    def _waiting(self) -> str:
        n = self.node
        return (
            f"waiting for all {n.nnodes} nodes in the rendezvous at {n.host}:{n.port} (up to "
            f"{n.rendezvous_timeout_s:g} s)"
        )

    def round_done(self, group_rank: int | None) -> None:
        self.attempt += 1
        self._first = None
        if self.restarts and self.restarts[-1].get("resumed_at") is None:
            self.restarts[-1]["resumed_at"] = now_iso()
        self.save(state="running", attempt=self.attempt, group_rank=group_rank, detail=None)

    def progress(self, checkpoint_step: int | None) -> None:
        if checkpoint_step is not None:
            self.wrote_checkpoint = True

    # ------------------------------------------------------------------ failures
    def worker_failed(self, ev: WorkerFailed, policy: Policy) -> str | None:
        """Record a failed worker of this node; why the group must end (None: restartable)."""
        if ev.pid in self._killed:
            return None  # the watchdog's kill, recorded as the stall
        rs = self._run_state(ev.pid)
        error = rs.get("last_error") if isinstance(rs.get("last_error"), str) else None
        exit_status = rs.get("exit_status")
        rec = failure_record(
            self.node,
            self.attempt,
            reason=signal_reason(ev.exitcode),
            local_rank=ev.local_rank,
            exitcode=ev.exitcode,
            error=error,
            failed_rank=rs.get("failed_rank") if isinstance(rs.get("failed_rank"), int) else None,
            peer=rs.get("peer_failure") is True,
        )
        self._note(rec)
        why = worker_no_restart(
            ev.exitcode, exit_status if isinstance(exit_status, int) else None, policy
        )
        if why is None:
            self.save()
            return None
        said = f": {error}" if error else ""
        return f"node {self.node.node_rank} rank {rec['rank']} {rec['reason']}: {why}{said}"

    def stalled(self, ranks: list[int], idle: float, limit: float) -> None:
        self._killed.update(ranks)
        rec = failure_record(
            self.node, self.attempt, reason=f"stalled {limit:g} s", local_rank=0, kind="stall"
        )
        self._first = None  # the stall is this round's cause, whatever the ranks die of
        self._note(rec)
        self.save(state="stalled", detail=f"no progress for {idle:.0f} s (limit {limit:g} s)")

    def agent_failed(self, life: AgentLife, why: str) -> None:
        code = life.returncode
        rec = failure_record(
            self.node, self.attempt, reason=why, exitcode=code, kind="agent", error=life.error
        )
        self._note(rec)

    def _note(self, rec: dict[str, Any]) -> None:
        self.failures.append(rec)
        if self._first is None:
            self._first = rec

    def _run_state(self, pid: int) -> dict[str, Any]:
        """This node's run-state when the worker `pid` wrote it (its first local rank)."""
        try:
            data = json.loads((self.file.run_dir / "run-state.json").read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) and data.get("pid") == pid else {}

    # ------------------------------------------------------------------ restarts and the end
    def restart_reason(self, torchrun_why: str) -> str:
        f = self._first
        if f is None:
            return f"{torchrun_why} (no failure on this node)"
        who = f"rank {f['rank']}" if f["rank"] is not None else "agent"
        return f"node {self.node.node_rank} {who}: {f['reason']}" + (
            " (its peer failed first)" if f["peer"] else ""
        )

    def restarting(self, kind: str, number: int, wait: float, console: Console) -> None:
        f = self._first or {}
        reason = self.restart_reason("a worker-group restart")
        self.restarts.append(
            {
                "at": now_iso(),
                "attempt": self.attempt + 1,
                "kind": kind,  # workers: torchrun restarts them; agent: this supervisor
                "reason": reason,
                "node_rank": f.get("node_rank"),
                "rank": f.get("rank"),
                "exit_status": f.get("exit_status"),
                "signal": f.get("signal"),
                "backoff_s": wait,
                "checkpoint_step": None,
                "resumed_step": None,
                "resumed_at": None,
            }
        )
        p = self.policy
        after = f", in {wait:g} s" if wait else ""
        detail = f"{reason}; group restart {number} of {p.max_restarts} within {p.restart_window_s:g} s{after}"
        console.say(format_phase_line("restarting", detail), status_log=True)
        self.save(state="restarting", detail=detail)

    def end(self, state: str, detail: str, status: int) -> int:
        self.save(state=state, detail=detail, exit_status=status, gave_up=state == "gave-up")
        return status
