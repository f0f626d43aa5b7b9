"""A group node's supervision, the pure parts: where the node sits, the group's restart budget,
what one agent's life ended with, and the record of each failure.

One policy per group: every node's supervisor gets the same flags and counts the same thing, the
group's restarts (each rendezvous round after the first is one, every node takes part in every
round, and an agent this supervisor restarts is one), within `restart_window_s`. So every node
reaches the group's limit at the same failure and gives up there; a node that gives up first
ends the others' rounds (node 0's store goes away, or the rendezvous times out waiting for it).
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field
from typing import Any, Literal

from trainer.config.policy import DIVERGENCE_MARKERS, Policy
from trainer.errors import ExitCode
from trainer.supervision.restarts import GiveUp, NextRestart
from trainer.supervision.statefile import now_iso


@dataclass(frozen=True)
class GroupNode:
    """This node's place in the group (the supervisor's --group-* flags)."""

    node_rank: int
    nnodes: int
    nproc: int  # ranks per node (torchrun's --nproc-per-node)
    host: str  # node 0's rendezvous endpoint
    port: int
    rendezvous_timeout_s: float
    rank_base: int | None = None  # DFLASH_RANK_BASE: the node's first global rank

    def global_rank(self, local_rank: int) -> int:
        """The inventory's numbering (trainer.pipeline.launch_env.launch_rank)."""
        base = self.node_rank * self.nproc if self.rank_base is None else self.rank_base
        return base + local_rank

    def as_json(self) -> dict[str, Any]:
        return {
            "node_rank": self.node_rank,
            "nnodes": self.nnodes,
            "nproc": self.nproc,
            "endpoint": f"{self.host}:{self.port}",
            "rendezvous_timeout_s": self.rendezvous_timeout_s,
        }


def endpoint_up(host: str, port: int, timeout: float = 1.0) -> bool:
    """Whether node 0's rendezvous store accepts a TCP connection (its agent is up)."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout):
            return True
    except OSError:
        return False


def signal_reason(code: int) -> str:
    return f"signal {-code}" if code < 0 else f"exit {code}"


@dataclass
class AgentLife:
    """What one agent (torchrun) did, as the supervisor saw it: the verdict's input."""

    returncode: int | None = None
    operator_stop: bool = False
    trainer_state: str | None = None  # this node's run-state (its first local rank's)
    trainer_exit: int | None = None
    errors: list[str] = field(default_factory=list)  # ERROR lines in status.log (node 0)
    no_restart: str | None = None  # why a worker's ending must not be restarted
    rendezvous: str | None = None  # the rendezvous error it died of (timeout, closed, ...)
    exhausted: bool = False  # torchrun spent its own --max-restarts
    stalled: bool = False  # the watchdog stopped it (node 0)
    error: str | None = None  # its own last words (`agent.error_line`)


GroupVerdict = Literal["finished", "stopped", "not-restarted", "failure"]


def agent_verdict(life: AgentLife, policy: Policy, node: GroupNode) -> tuple[GroupVerdict, str]:
    """What an agent's ending means for this node, with a one-line why (pure)."""
    code = life.returncode if life.returncode is not None else 1
    if life.operator_stop:
        return "stopped", "stopped by the operator"
    if life.no_restart is not None:
        return "not-restarted", life.no_restart
    if code == 0 and life.trainer_state == "finished":
        return "finished", "the trainer finished (exit 0)"
    if code == 0 and life.trainer_state == "stopped":
        return "stopped", "the trainer was stopped by a signal (exit 0)"
    if any(m in e for e in life.errors for m in DIVERGENCE_MARKERS):
        return "not-restarted", "non-finite divergence: a restart would repeat it"
    if life.rendezvous == "timeout":
        return "not-restarted", (
            f"the rendezvous timed out: not all {node.nnodes} nodes joined within "
            f"{node.rendezvous_timeout_s:g} s"
        )
    if policy.restart == "never":
        return "not-restarted", f"the agent ended ({signal_reason(code)}); restart = never"
    if life.rendezvous is not None:
        return "failure", f"its rendezvous failed ({life.rendezvous})"
    if life.exhausted:
        return "failure", "torchrun spent its --max-restarts"
    if code < 0:
        return "failure", f"killed by signal {-code}"
    return "failure", f"exited ({signal_reason(code)})"


def worker_no_restart(exitcode: int, trainer_exit: int | None, policy: Policy) -> str | None:
    """Why a worker's exit must end the group instead of a restart (None: restartable)."""
    for code in (exitcode, trainer_exit):
        if code == ExitCode.UNSAVED:
            return (
                f"checkpoints kept failing (exit {int(ExitCode.UNSAVED)}): a restart would "
                "train steps that cannot be kept"
            )
        if code is not None and code in policy.no_restart_exit_codes:
            return f"exit {code} is in no_restart_exit_codes"
    return None


class GroupBudget:
    """The group's restarts within the window, as this node counts them.

    `restart(now)` is asked at every restart trigger: torchrun restarting its workers (once per
    rendezvous round: a trigger in a round that already counted one is the same restart) or
    an agent this supervisor is about to restart (always a restart of its own)."""

    def __init__(self, policy: Policy) -> None:
        self.policy = policy
        self.times: list[float] = []
        self.reasons: list[str] = []
        self._counted_this_round = False

    def new_round(self) -> None:
        self._counted_this_round = False

    def restart(self, now: float, why: str, *, agent: bool = False) -> NextRestart | GiveUp | None:
        """The restart a trigger at `now` is (None: this round's restart, counted already),
        or the give-up when the window holds `max_restarts` already."""
        if self._counted_this_round and not agent:
            return None
        window = self.policy.restart_window_s
        recent = [t for t in self.times if now - t <= window]
        self.reasons.append(why)
        if self.policy.restart == "never" or len(recent) >= self.policy.max_restarts:
            last = self.reasons[-(len(recent) + 1) :]
            return GiveUp(f"after {len(recent)} group restarts: " + ", ".join(last))
        self.times.append(now)
        self._counted_this_round = True
        number = len(recent) + 1
        return NextRestart(number, self.policy.backoff(number))


def failure_record(
    node: GroupNode,
    attempt: int,
    *,
    reason: str,
    local_rank: int | None = None,
    exitcode: int | None = None,
    error: str | None = None,
    failed_rank: int | None = None,
    peer: bool = False,
    kind: str = "rank",
) -> dict[str, Any]:
    """One failure on this node, for supervisor.json `failures` (dflashctl merges the nodes'
    records per attempt and names the first): `peer` = the rank failed because another did."""
    return {
        "at": now_iso(),
        "attempt": attempt,
        "kind": kind,  # rank | stall | agent
        "node_rank": node.node_rank,
        "rank": node.global_rank(local_rank) if local_rank is not None else None,
        "local_rank": local_rank,
        "exit_status": exitcode,
        "signal": -exitcode if exitcode is not None and exitcode < 0 else None,
        "reason": reason,
        "error": error,
        "failed_rank": failed_rank,
        "peer": peer,
    }


def _flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


def group_node_of(argv: list[str], node_rank: int) -> GroupNode:
    """This node's place from the torchrun argv dflashctl built (its --nnodes,
    --nproc-per-node, --rdzv-endpoint and --rdzv-conf join_timeout): one source for both.
    ValueError naming the flag when it is missing or not what a group node runs."""
    nnodes, nproc = _flag(argv, "--nnodes"), _flag(argv, "--nproc-per-node")
    endpoint = _flag(argv, "--rdzv-endpoint")
    conf = dict(
        kv.split("=", 1) for kv in (_flag(argv, "--rdzv-conf") or "").split(",") if "=" in kv
    )
    if nnodes is None or not nnodes.isdigit():
        raise ValueError(f"--group-node: the torchrun argv has no --nnodes N (got {nnodes!r})")
    if nproc is None or not nproc.isdigit():
        raise ValueError(f"--group-node: the torchrun argv has no --nproc-per-node N ({nproc!r})")
    host, _, port = (endpoint or "").rpartition(":")
    if not host or not port.isdigit():
        raise ValueError("--group-node: the torchrun argv has no --rdzv-endpoint HOST:PORT")
    if not 0 <= node_rank < int(nnodes):
        raise ValueError(f"--group-node {node_rank}: not a node of --nnodes {nnodes}")
    timeout = conf.get("join_timeout", "600")
    base = os.environ.get("DFLASH_RANK_BASE", "")
    return GroupNode(
        rank_base=int(base) if base.isdigit() else None,
        node_rank=node_rank,
        nnodes=int(nnodes),
        nproc=int(nproc),
        host=host,
        port=int(port),
        rendezvous_timeout_s=float(timeout) if timeout.isdigit() else 600.0,
    )
