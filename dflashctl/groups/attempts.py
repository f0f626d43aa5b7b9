"""A supervised group's history, from its nodes' supervisor records (pure).

Every node's supervisor (`trainer.supervision.group_record`) records the failures it saw on its
own node and the group restarts it counted, each with the group's attempt (the rendezvous
round: every node takes part in every round, so the numbers agree). Put side by side, they say
per attempt which node and rank failed first and why; a failure that only followed another
(its rank's collective broke because a peer died: `peer`) never is the cause when the cause
was recorded.

Which failure of an attempt came first, in this order:
1. the rank a failed rank published as the first failure (`failed_rank`: it failed by itself);
2. node 0's stall watchdog (it decided the attempt was hung);
3. a rank that failed by itself and was killed by a signal (nothing else records those);
4. a rank that failed by itself;
5. an agent that died (killed, or exited by itself);
6. a rank that failed because a peer did;
7. an agent that only followed another's failure (torchrun spent its --max-restarts after its
   workers failed, its rendezvous was closed or lost with node 0's agent); ties go to the
   earlier record, then node order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dflashctl.runs.snapshot import iso_time

# an agent's ending that follows a failure recorded elsewhere (its workers', another agent's)
_CONSEQUENCES = ("torchrun spent its --max-restarts", "its rendezvous failed")


@dataclass(frozen=True)
class Failure:
    """One failure a node's supervisor recorded."""

    host: str
    node_rank: int
    attempt: int
    kind: str  # rank | stall | agent
    rank: int | None
    reason: str  # `signal 9`, `exit 1`, `stalled 900 s`, `the agent was killed by signal 9`
    error: str | None  # the rank's own ERROR line (its node's run-state), when it wrote one
    failed_rank: int | None
    peer: bool
    at: float | None

    def line(self) -> str:
        """`node 1 (n1) rank 1: signal 9: ERROR text`."""
        who = f"rank {self.rank}" if self.rank is not None else "agent"
        said = f": {self.error}" if self.error else ""
        return f"node {self.node_rank} ({self.host}) {who}: {self.reason}{said}"


@dataclass(frozen=True)
class Attempt:
    """A group attempt that ended in a failure, and whether the group restarted after it."""

    number: int
    first: Failure
    restarted: bool  # a restart record for attempt number + 1 exists on some node
    resumed: bool  # that restart's rendezvous round completed (the group trains again)

    def line(self) -> str:
        return f"attempt {self.number}: {self.first.line()}"


def failures_of(host: str, node_rank: int, supervisor: dict[str, Any] | None) -> list[Failure]:
    """A node's recorded failures (its supervisor.json `failures`), oldest first."""
    raw = (supervisor or {}).get("failures")
    out = []
    for f in raw if isinstance(raw, list) else []:
        if not isinstance(f, dict) or not isinstance(f.get("attempt"), int):
            continue
        out.append(
            Failure(
                host=host,
                node_rank=node_rank,
                attempt=f["attempt"],
                kind=str(f.get("kind") or "rank"),
                rank=f["rank"] if isinstance(f.get("rank"), int) else None,
                reason=str(f.get("reason") or "?"),
                error=f["error"] if isinstance(f.get("error"), str) else None,
                failed_rank=f["failed_rank"] if isinstance(f.get("failed_rank"), int) else None,
                peer=f.get("peer") is True,
                at=iso_time(f.get("at")),
            )
        )
    return out


def _order(f: Failure, published: set[int]) -> tuple[int, float, int]:
    if f.rank is not None and f.rank in published and not f.peer:
        tier = 0
    elif f.kind == "stall":
        tier = 1
    elif f.kind == "rank" and not f.peer:
        tier = 2 if f.reason.startswith("signal") else 3
    elif f.kind == "agent" and not f.reason.startswith(_CONSEQUENCES):
        tier = 4
    elif f.kind == "agent":
        tier = 6
    else:
        tier = 5
    return tier, f.at if f.at is not None else float("inf"), f.node_rank


def first_of(failures: Sequence[Failure]) -> Failure | None:
    """The failure that came first among one attempt's (rules in the module docstring)."""
    if not failures:
        return None
    published = {f.failed_rank for f in failures if f.failed_rank is not None}
    return min(failures, key=lambda f: _order(f, published))


def attempts(failures: Sequence[Failure], restarts: Sequence[dict[str, Any]]) -> list[Attempt]:
    """Every failed attempt, oldest first, with its first failure and what followed it;
    `restarts` is every node's restart records together."""
    by_attempt: dict[int, list[Failure]] = {}
    for f in failures:
        by_attempt.setdefault(f.attempt, []).append(f)
    out = []
    for number in sorted(by_attempt):
        first = first_of(by_attempt[number])
        assert first is not None
        after = [r for r in restarts if r.get("attempt") == number + 1]
        out.append(
            Attempt(
                number,
                first,
                restarted=bool(after),
                resumed=any(r.get("resumed_at") for r in after),
            )
        )
    return out
