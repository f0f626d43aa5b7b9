"""A group (a multi-node run) as one thing: its nodes' handles in rank order, and its state.

`group_state` is pure: from what each node reports (`NodeReport`, node 0 first) it decides the
group's state and, when the run failed, which node and rank failed first. The CLI's `status
GROUP`, the watch and the TUI's group row all use it, so "one node unreachable" means the same
everywhere: that node is unreachable (the group is `degraded`), never that the run crashed: a
lost link says nothing about the job (the peers' 24 false recoveries came from reading it so).

Ranks are the launch's global ranks throughout (the inventory's order on a group node, whatever
c10d's numbering of the agents; `rank_range`, `failed_rank`, torchrun's own
report), target processes of an M:N run included, so a recorded rank finds its node.
Which failure came first, in this order:
1. a global rank the trainer itself recorded (`failed_rank` in a node's run-state.json);
2. torchrun's own report in a dead pane ("rank: N (local_rank: M)" with a signal exit code);
3. a node whose trainer died without recording its end (killed: its run-state still says
   running or starting), first in node order;
4. the first node in node order that crashed.
A peer that lost its partner fails too (its collective breaks); it is reported as stopped with
the group, not as the cause.

A supervised group (every node's `trainer.supervise --group-node`): the supervisors' records
decide. A node whose supervisor gave up or would not restart ends the group (`gave-up`,
`failed`) with its reason; each attempt's first failure comes from every node's records side by
side (`groups.attempts`); a node restarting (torchrun restarting its workers, or the supervisor
its agent) makes the group `restarting`, and nodes waiting for the others in the rendezvous
make it `rendezvous` (k of N nodes there).

Checkpoints are node 0's alone (global rank 0 writes them, `checkpoint_node`); the other nodes'
run-states name none, and `GroupView.checkpoint_json`/`checkpoint_line` say where they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, TypedDict

from dflashctl.groups.attempts import Attempt, attempts, failures_of
from dflashctl.runs.snapshot import RunStatus
from dflashctl.runs.snapshot import torchrun_failure as torchrun_failure
from trainer.events.run_state import RunState

GroupPhase = Literal[
    "running",  # every node runs
    "restarting",  # a node restarts its part (torchrun its workers, a supervisor its agent)
    "rendezvous",  # nodes wait in the rendezvous for the others (k of N there)
    "gave-up",  # a node's supervisor spent the group's restarts (or the rendezvous timed out)
    "degraded",  # some node unreachable, none failed: that node is unknown, not crashed
    "failed",  # a node failed and is not restarted (an exit that must not be, or no supervisor)
    "partial",  # some nodes run, others are stopped (a start or stop in progress, or by hand)
    "stopped",  # every node stopped (some may have finished)
    "finished",  # every node finished the plan
    "unreachable",  # no node answered
]
FAILED_NODE_STATES = frozenset({"crashed", "gave-up"})
LIVE_NODE_STATES = frozenset({"running", "restarting", "stalled", "rendezvous"})


@dataclass(frozen=True)
class NodeReport:
    """What one node of a group says about its part of the run (the input of `group_state`).

    `state` is the host's state as `RunStatus.state` names it (running, stopped, crashed,
    gave-up, unreachable, ...); `run_state` is that node's own run-state.json (node-level
    fields from the trainer: node_rank, rank_range, step, failed_rank); `pane_tail` the dead
    pane's last lines (torchrun's failure report), empty while it runs.
    """

    host: str
    node_rank: int
    state: str
    exit_status: int | None = None
    finished: bool = False
    release: str | None = None
    config_hash: str | None = None
    deployed_config_hash: str | None = None
    step: int | None = None
    message: str | None = None
    run_state: RunState = field(default_factory=RunState)
    pane_tail: tuple[str, ...] = ()
    last_error: str | None = None  # the node's last ERROR line (status.log or its pane)
    supervisor: dict[str, Any] | None = None  # its supervisor's record (status `supervisor`)
    pane_lines: tuple[str, ...] = ()  # the pane's last lines, whatever its state

    @classmethod
    def from_status(cls, st: RunStatus, node_rank: int) -> NodeReport:
        """A node's report from `dflashctl status`'s RunStatus of its host."""
        rs = st.run_state
        return cls(
            host=st.host,
            node_rank=node_rank,
            state=st.state,
            exit_status=st.exit_status,
            finished=st.finished,
            release=st.release,
            config_hash=st.config_hash,
            deployed_config_hash=st.deployed_config_hash,
            step=rs.step if rs.step is not None else _known_step(st),
            message=st.message,
            run_state=rs,
            pane_tail=tuple(st.pane_tail),
            last_error=st.last_error,
            supervisor=st.supervisor,
            pane_lines=tuple(st.pane_lines),
        )

    @property
    def rank_range(self) -> tuple[int, int] | None:
        """[first, last + 1) of the global ranks on this node, as its trainer recorded them."""
        rr = self.run_state.rank_range
        if rr is None or len(rr) != 2:
            return None
        return rr[0], rr[1]

    @property
    def reachable(self) -> bool:
        return self.state != "unreachable"

    @property
    def failed(self) -> bool:
        return self.state in FAILED_NODE_STATES

    @property
    def sup_state(self) -> str | None:
        """Its supervisor's own state (running, restarting, rendezvous, gave-up, ...)."""
        got = (self.supervisor or {}).get("state")
        return got if isinstance(got, str) else None

    @property
    def sup_detail(self) -> str | None:
        got = (self.supervisor or {}).get("detail")
        return got if isinstance(got, str) else None

    @property
    def attempt(self) -> int | None:
        got = (self.supervisor or {}).get("attempt")
        return got if isinstance(got, int) else None

    @property
    def restarts(self) -> list[dict[str, Any]]:
        got = (self.supervisor or {}).get("restarts")
        return [r for r in got if isinstance(r, dict)] if isinstance(got, list) else []

    @property
    def error(self) -> str | None:
        """This node's own error line: what its trainer recorded (its first local rank's, in
        run-state.json), else the last ERROR line its log or pane shows."""
        return self.run_state.last_error or self.last_error

    @property
    def unrecorded_death(self) -> bool:
        """It failed and its trainer never wrote how it ended (killed: no handler ran)."""
        return self.failed and self.run_state.state in {None, "starting", "running"}


@dataclass(frozen=True)
class FailedRank:
    """The node and rank that failed first (`rank` None: the node has several, which is unknown)."""

    host: str
    node_rank: int
    rank: int | None
    why: str  # how that was decided, for people
    error: str | None = None  # that node's own error line (never another node's, never a banner)


class FailedJson(TypedDict):
    host: str
    node_rank: int
    rank: int | None


class CheckpointJson(TypedDict):
    """Where the run's checkpoints are: the writer node, and its newest one (None: none yet)."""

    host: str
    node_rank: int
    step: int | None
    path: str | None  # in that node's run dir (no other node has a copy)


@dataclass(frozen=True)
class GroupView:
    """A group's state from its nodes' reports (node 0 first)."""

    group: str
    state: GroupPhase
    nodes: tuple[NodeReport, ...]
    failed: FailedRank | None = None
    history: tuple[Attempt, ...] = ()  # each failed attempt's first failure (supervised)
    verdict: str | None = None  # the supervisor's word that ended it (gave-up, failed)

    @property
    def waiting(self) -> tuple[str, ...]:
        """Nodes whose agent waits in the rendezvous for the others."""
        return tuple(n.host for n in self.nodes if n.state == "rendezvous")

    @property
    def attempt(self) -> int | None:
        """The group's attempt (rendezvous round) as its nodes count it: the highest."""
        got = [n.attempt for n in self.nodes if n.attempt is not None]
        return max(got) if got else None

    @property
    def unreachable(self) -> tuple[str, ...]:
        return tuple(n.host for n in self.nodes if not n.reachable)

    @property
    def world_size(self) -> int | None:
        """The run's world size as node 0's trainer recorded it (None: not known yet)."""
        return self.nodes[0].run_state.world_size if self.nodes else None

    @property
    def step(self) -> int | None:
        """Node 0's step (the run's: rank 0 writes checkpoints and status lines)."""
        return self.nodes[0].step if self.nodes else None

    @property
    def checkpoint_node(self) -> NodeReport | None:
        """The node whose run dir holds the run's checkpoints: the one every node's run-state
        names (`checkpoint_node`), else node 0 (global rank 0 writes them); the other nodes'
        run-states name no checkpoint."""
        named = [n.run_state.checkpoint_node for n in self.nodes]
        writer = next((w for w in named if w is not None), 0)
        return next((n for n in self.nodes if n.node_rank == writer), None)

    def checkpoint_json(self) -> CheckpointJson | None:
        n = self.checkpoint_node
        if n is None:
            return None
        rs = n.run_state
        return CheckpointJson(
            host=n.host, node_rank=n.node_rank, step=rs.last_step, path=rs.last_checkpoint
        )

    def checkpoint_line(self) -> str | None:
        """`checkpoints on node 0 (n0): step 40 run/checkpoints/step-00000040.pt`, one line."""
        c = self.checkpoint_json()
        if c is None:
            return None
        where = f"checkpoints on node {c['node_rank']} ({c['host']})"
        if c["path"] is None:
            return f"{where}: none recorded yet"
        step = f"step {c['step']} " if c["step"] is not None else ""
        return f"{where}: {step}{c['path']}"

    def summary(self) -> str:
        """`g: failed: node 1 (n1) rank 1 failed first (...)` and the like, one line."""
        head = f"{self.group}: {self.state}"
        if self.state == "rendezvous":
            head = f"{head} ({len(self.waiting)}/{len(self.nodes)} nodes)"
        if self.history and self.state in ("gave-up", "failed"):
            tried = "; ".join(a.line() for a in self.history)
            return f"{head}: {self.verdict or 'ended'}; {tried}"
        if self.history and self.state in ("restarting", "rendezvous"):
            last = self.history[-1]
            others = [n.host for n in self.nodes if n.state != "rendezvous"]
            wait = f"; waiting for {', '.join(others)}" if self.state == "rendezvous" else ""
            return f"{head}: after {last.line()}{wait}"
        if self.state == "rendezvous":
            others = [f"{n.host} ({n.state})" for n in self.nodes if n.state != "rendezvous"]
            return f"{head}: waiting for {', '.join(others)}" if others else head
        if self.verdict and self.failed is None:
            return f"{head}: {self.verdict}"
        if self.failed is not None:
            f = self.failed
            rank = f"rank {f.rank}" if f.rank is not None else "rank unknown"
            said = f": {f.error}" if f.error else ""
            return f"{head}: node {f.node_rank} ({f.host}) {rank} failed first ({f.why}){said}"
        if self.state == "degraded":
            running = [n for n in self.nodes if n.reachable and n.state in LIVE_NODE_STATES]
            at = f", node 0 at step {self.step}" if self.step is not None else ""
            more = (
                f"; the group may still train ({len(running)} reachable node(s) run{at})"
                if running
                else ""
            )
            return f"{head}: {', '.join(self.unreachable)} unreachable (state unknown){more}"
        if self.state == "partial":
            live = [n.host for n in self.nodes if n.state in LIVE_NODE_STATES]
            idle = [n.host for n in self.nodes if n.state not in LIVE_NODE_STATES]
            return f"{head}: running on {', '.join(live)}; not on {', '.join(idle)}"
        return head

    def failed_json(self) -> FailedJson | None:
        if self.failed is None:
            return None
        f = self.failed
        return FailedJson(host=f.host, node_rank=f.node_rank, rank=f.rank)


def _known_step(st: RunStatus) -> int | None:
    """Without the node's own step: the later of its last status line and its last checkpoint
    (a stop's checkpoint comes after the last status line)."""
    known = [x for x in (st.step, st.run_state.last_step) if x is not None]
    return max(known) if known else None


def _node_of_rank(nodes: Sequence[NodeReport], rank: int) -> NodeReport | None:
    for n in nodes:
        rr = n.rank_range
        if rr is not None and rr[0] <= rank < rr[1]:
            return n
    return None


def _only_rank(node: NodeReport) -> int | None:
    rr = node.rank_range
    return rr[0] if rr is not None and rr[1] - rr[0] == 1 else None


def first_failure(nodes: Sequence[NodeReport]) -> FailedRank | None:
    """The node and rank that failed first (rules in the module docstring); None: none failed."""
    failed = [n for n in nodes if n.failed]
    if not failed:
        return None
    for n in nodes:
        rank = n.run_state.failed_rank
        if rank is not None:
            owner = _node_of_rank(nodes, rank) or n
            return FailedRank(
                owner.host, owner.node_rank, rank, f"recorded by {n.host}", owner.error
            )
    for n in failed:  # a trainer that refused (exit 2) names its own reason; the rest followed
        if n.run_state.state == "refused":
            rep = torchrun_failure(n.pane_tail)
            rank = rep[0] if rep is not None else _only_rank(n)
            return FailedRank(n.host, n.node_rank, rank, "its trainer refused to start", n.error)
    reports = [(n, torchrun_failure(n.pane_tail)) for n in failed]
    for n, rep in reports:
        if rep is not None and rep[1] < 0:
            why = f"killed by signal {-rep[1]}"
            return FailedRank(n.host, n.node_rank, rep[0], why, n.error)
    for n in failed:
        if n.unrecorded_death:
            rep = torchrun_failure(n.pane_tail)
            rank = rep[0] if rep is not None else _only_rank(n)
            why = "its trainer died without a record"
            return FailedRank(n.host, n.node_rank, rank, why, n.error)
    n = failed[0]
    rep = torchrun_failure(n.pane_tail)
    rank = n.run_state.failed_rank or (rep[0] if rep is not None else _only_rank(n))
    how = f"exit status {n.exit_status}" if n.exit_status is not None else n.state
    return FailedRank(n.host, n.node_rank, rank, f"first in node order to fail: {how}", n.error)


def group_state(group: str, nodes: Sequence[NodeReport]) -> GroupView:
    """The group's state from its nodes' reports, node 0 first (pure).

    running: every node runs; failed: a node failed (named with its rank, `first_failure`),
    whatever the others say (they are going down with it); degraded: some node is unreachable
    and none failed; unreachable: none answered; finished: all finished; stopped: none runs;
    partial: some run and some do not.
    """
    ordered = tuple(sorted(nodes, key=lambda n: n.node_rank))
    history = tuple(
        attempts(
            [f for n in ordered for f in failures_of(n.host, n.node_rank, n.supervisor)],
            [r for n in ordered for r in n.restarts],
        )
    )
    ended = _ended_by(ordered)
    if ended is not None:
        state: GroupPhase = "gave-up" if ended.sup_state == "gave-up" else "failed"
        last = history[-1].first if history else None
        failed = (
            FailedRank(last.host, last.node_rank, last.rank, last.reason, last.error)
            if last is not None
            else None
        )
        return GroupView(group, state, ordered, failed, history, ended.sup_detail)
    failure = first_failure(ordered)
    if failure is not None:
        return GroupView(group, "failed", ordered, failure, history)
    reachable = [n for n in ordered if n.reachable]
    if not reachable:
        state = "unreachable"
    elif len(reachable) < len(ordered):
        state = "degraded"
    elif any(n.state in ("restarting", "stalled") for n in ordered):
        state = "restarting"
    elif any(n.state == "rendezvous" for n in ordered) and all(
        n.state in LIVE_NODE_STATES for n in ordered
    ):
        state = "rendezvous"
    elif all(n.state in LIVE_NODE_STATES for n in ordered):
        state = "running"
    elif all(n.finished for n in ordered):
        state = "finished"
    elif not any(n.state in LIVE_NODE_STATES for n in ordered):
        state = "stopped"
    else:
        state = "partial"
    return GroupView(group, state, ordered, None, history)


def _ended_by(nodes: Sequence[NodeReport]) -> NodeReport | None:
    """The node whose supervisor ended the group: one that would not restart (its reason is
    the cause) before one that gave up, else None."""
    for wanted in ("not-restarted", "gave-up"):
        for n in nodes:
            if n.sup_state == wanted:
                return n
    return None


class NodeJson(TypedDict):
    host: str
    node_rank: int
    rank_range: list[int] | None
    state: str
    release: str | None
    config_hash: str | None
    deployed_config_hash: str | None
    step: int | None
    exit_status: int | None
    message: str | None
    supervisor: str | None  # its supervisor's state (rendezvous, restarting, gave-up, ...)
    detail: str | None  # its supervisor's detail (why it waits, restarts or ended)
    error: str | None  # its own last error line
    pane: list[str]  # the pane's last lines


class AttemptJson(TypedDict):
    attempt: int
    host: str
    node_rank: int
    rank: int | None
    reason: str
    error: str | None
    restarted: bool
    resumed: bool


class GroupJson(TypedDict):
    group: str
    state: str
    summary: str
    world_size: int | None
    step: int | None
    attempt: int | None
    waiting: list[str]
    verdict: str | None
    nodes: list[NodeJson]
    failed: FailedJson | None
    restarts: list[AttemptJson]
    checkpoint: CheckpointJson | None


def group_json(view: GroupView) -> GroupJson:
    """`status GROUP --json`: the group's state, one entry per node, the first failure, and
    where the run's checkpoints are (the writer node's newest)."""
    return GroupJson(
        group=view.group,
        state=view.state,
        summary=view.summary(),
        world_size=view.world_size,
        step=view.step,
        attempt=view.attempt,
        waiting=list(view.waiting),
        verdict=view.verdict,
        nodes=[
            NodeJson(
                host=n.host,
                node_rank=n.node_rank,
                rank_range=list(n.rank_range) if n.rank_range is not None else None,
                state="finished" if n.finished else n.state,
                release=n.release,
                config_hash=n.config_hash,
                deployed_config_hash=n.deployed_config_hash,
                step=n.step,
                exit_status=n.exit_status,
                message=n.message,
                supervisor=n.sup_state,
                detail=n.sup_detail,
                error=n.error,
                pane=list(n.pane_lines),
            )
            for n in view.nodes
        ],
        failed=view.failed_json(),
        restarts=[
            AttemptJson(
                attempt=a.number,
                host=a.first.host,
                node_rank=a.first.node_rank,
                rank=a.first.rank,
                reason=a.first.reason,
                error=a.first.error,
                restarted=a.restarted,
                resumed=a.resumed,
            )
            for a in view.history
        ],
        checkpoint=view.checkpoint_json(),
    )
