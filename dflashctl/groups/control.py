"""A group (a multi-node run) as one thing: its nodes' handles in rank order, and its state.

`group_state` is pure: from what each node reports (`NodeReport`, node 0 first) it decides the
group's state and, when the run failed, which node and rank failed first. The CLI's `status
GROUP`, the watch and the TUI's group row all use it, so "one node unreachable" means the same
everywhere: that node is unreachable (the group is `degraded`), never that the run crashed: a
lost link says nothing about the job (the peers' 24 false recoveries came from reading it so).

Ranks are torchrun's global ranks throughout (`rank_range`, `failed_rank`, torchrun's own
report), target processes of an M:N run included, so a recorded rank finds its node.
Which failure came first, in this order:
1. a global rank the trainer itself recorded (`failed_rank` in a node's run-state.json);
2. torchrun's own report in a dead pane ("rank: N (local_rank: M)" with a signal exit code);
3. a node whose trainer died without recording its end (killed: its run-state still says
   running or starting), first in node order;
4. the first node in node order that crashed.
A peer that lost its partner fails too (its collective breaks); it is reported as stopped with
the group, not as the cause.

Checkpoints are node 0's alone (global rank 0 writes them, `checkpoint_node`); the other nodes'
run-states name none, and `GroupView.checkpoint_json`/`checkpoint_line` say where they are.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Literal, TypedDict, TypeVar

from dflashctl.errors import DflashctlError
from dflashctl.groups.launch import group_launches
from dflashctl.releases.deploy import DeployResult, deploy
from dflashctl.remote.transport import HostUnreachable, Transport
from dflashctl.runs.control import RunControl
from dflashctl.runs.service import (
    DEFAULT_START_WAIT_S,
    ControlError,
    MeasureInProgress,
    StartFailed,
    StartResult,
    StopResult,
    measure_refusal,
)
from dflashctl.runs.snapshot import RunStatus
from dflashctl.runs.starter import NodeCommand
from trainer.events.run_state import RunState

if TYPE_CHECKING:
    from dflashctl.config.inventory import GroupConfig
    from dflashctl.fleet import HostHandle
    from dflashctl.releases.release import Release

T = TypeVar("T")
SETTLE_S = 60.0
"""After a group stop's checkpoint, how long each node's torchrun gets to exit by itself
(its agents meet at an exit barrier) before its session is ended."""
PORT_WAIT_S = 60.0
"""How long start waits for node 0's rendezvous port to be free (a stopped torchrun that
was ended by its session's end shuts down for up to 30 s and holds it meanwhile)."""
# Run with the node's python: exits 0 once PORT can be listened on (as torchrun's store does,
# SO_REUSEADDR), 1 if it is still taken after SECONDS.
PORT_FREE_SCRIPT = """
import socket, sys, time
port, end = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while True:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        s.bind(("", port))
        s.listen(1)
        sys.exit(0)
    except OSError as err:
        if time.monotonic() > end:
            print(err.strerror or err)
            sys.exit(1)
    finally:
        s.close()
    time.sleep(0.5)
"""


def port_free_argv(python: str, port: int, seconds: float) -> list[str]:
    """Wait (on the node) until `port` can be listened on; see PORT_FREE_SCRIPT."""
    return [python, "-c", PORT_FREE_SCRIPT, str(int(port)), f"{seconds:g}"]


Progress = Callable[[str], None]

GroupPhase = Literal[
    "running",  # every node runs
    "degraded",  # some node unreachable, none failed: that node is unknown, not crashed
    "failed",  # a node failed (the group goes down with it: torchrun's behaviour)
    "partial",  # some nodes run, others are stopped (a start or stop in progress, or by hand)
    "stopped",  # every node stopped (some may have finished)
    "finished",  # every node finished the plan
    "unreachable",  # no node answered
]
FAILED_NODE_STATES = frozenset({"crashed", "gave-up"})
LIVE_NODE_STATES = frozenset({"running", "restarting", "stalled"})
# torchrun's failure report (torch.distributed.elastic's ChildFailedError), one per failed rank:
#   rank      : 1 (local_rank: 0)
#   exitcode  : -9 (pid: 1234)
_TORCHRUN_RANK = re.compile(r"\brank\s*:\s*(\d+)\s*\(local_rank:\s*\d+\)")
_TORCHRUN_EXIT = re.compile(r"\bexitcode\s*:\s*(-?\d+)")


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
        if self.failed is not None:
            f = self.failed
            rank = f"rank {f.rank}" if f.rank is not None else "rank unknown"
            return f"{head}: node {f.node_rank} ({f.host}) {rank} failed first ({f.why})"
        if self.state == "degraded":
            return f"{head}: {', '.join(self.unreachable)} unreachable (state unknown)"
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


def torchrun_failure(pane_tail: Sequence[str]) -> tuple[int, int] | None:
    """(global rank, exit code) of the first rank torchrun reported failed in this pane."""
    rank: int | None = None
    lines = list(pane_tail)
    # "Failures:" lists the other ranks first; "Root Cause (first observed failure)" is the one
    roots = [i for i, line in enumerate(lines) if "Root Cause" in line]
    for line in lines[roots[-1] :] if roots else lines:
        m = _TORCHRUN_RANK.search(line)
        if m:
            rank = int(m.group(1))
            continue
        e = _TORCHRUN_EXIT.search(line)
        if e and rank is not None:
            return rank, int(e.group(1))
    return None


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
            return FailedRank(owner.host, owner.node_rank, rank, f"recorded by {n.host}")
    reports = [(n, torchrun_failure(n.pane_tail)) for n in failed]
    for n, rep in reports:
        if rep is not None and rep[1] < 0:
            return FailedRank(n.host, n.node_rank, rep[0], f"killed by signal {-rep[1]}")
    for n in failed:
        if n.unrecorded_death:
            rep = torchrun_failure(n.pane_tail)
            rank = rep[0] if rep is not None else _only_rank(n)
            return FailedRank(n.host, n.node_rank, rank, "its trainer died without a record")
    n = failed[0]
    rep = torchrun_failure(n.pane_tail)
    rank = n.run_state.failed_rank or (rep[0] if rep is not None else _only_rank(n))
    how = f"exit status {n.exit_status}" if n.exit_status is not None else n.state
    return FailedRank(n.host, n.node_rank, rank, f"first in node order to fail: {how}")


def group_state(group: str, nodes: Sequence[NodeReport]) -> GroupView:
    """The group's state from its nodes' reports, node 0 first (pure).

    running: every node runs; failed: a node failed (named with its rank, `first_failure`),
    whatever the others say (they are going down with it); degraded: some node is unreachable
    and none failed; unreachable: none answered; finished: all finished; stopped: none runs;
    partial: some run and some do not.
    """
    ordered = tuple(sorted(nodes, key=lambda n: n.node_rank))
    failure = first_failure(ordered)
    if failure is not None:
        return GroupView(group, "failed", ordered, failure)
    reachable = [n for n in ordered if n.reachable]
    state: GroupPhase
    if not reachable:
        state = "unreachable"
    elif len(reachable) < len(ordered):
        state = "degraded"
    elif all(n.state in LIVE_NODE_STATES for n in ordered):
        state = "running"
    elif all(n.finished for n in ordered):
        state = "finished"
    elif not any(n.state in LIVE_NODE_STATES for n in ordered):
        state = "stopped"
    else:
        state = "partial"
    return GroupView(group, state, ordered)


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


class GroupJson(TypedDict):
    group: str
    state: str
    summary: str
    world_size: int | None
    step: int | None
    nodes: list[NodeJson]
    failed: FailedJson | None
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
            )
            for n in view.nodes
        ],
        failed=view.failed_json(),
        checkpoint=view.checkpoint_json(),
    )


@dataclass
class GroupHandle:
    """A group's nodes as host handles, node 0 first (what the TUI and the CLI hold per group)."""

    config: GroupConfig
    nodes: list[HostHandle]

    @property
    def name(self) -> str:
        return self.config.name

    async def reports(self) -> list[NodeReport]:
        """Every node's status at once (an unreachable node is a report, never an error)."""
        import asyncio

        statuses = await asyncio.gather(*(h.control.status() for h in self.nodes))
        return [NodeReport.from_status(st, i) for i, st in enumerate(statuses)]

    async def view(self) -> GroupView:
        return group_state(self.name, await self.reports())


# --- operating a group: every node through its own RunControl ----------------------------------


@dataclass(frozen=True)
class NodeOutcome(Generic[T]):
    """One node's part of a group command: its result, or the one-line error it failed with."""

    host: str
    node_rank: int
    result: T | None = None
    error: BaseException | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    def error_line(self) -> str:
        err = self.error
        if err is None:
            return ""
        text = err.one_line() if isinstance(err, DflashctlError) else str(err)
        text = text or type(err).__name__
        return text if text.startswith(f"{self.host}:") else f"{self.host}: {text}"


@dataclass(frozen=True)
class GroupStartResult:
    group: str
    started: bool  # False: every node was running already
    nodes: list[StartResult]
    release: str
    config_hash: str | None
    ready: bool | None  # node 0 past its setup (None: not waited for)
    waited_s: float = 0.0


@dataclass(frozen=True)
class GroupStopResult:
    group: str
    nodes: list[StopResult]  # node 0 first

    @property
    def checkpoint_step(self) -> int | None:
        ck = self.nodes[0].checkpoint if self.nodes else None
        return ck.step if ck is not None else None


async def _each(
    names: Sequence[str], calls: Sequence[Awaitable[T]], first_rank: int = 0
) -> list[NodeOutcome[T]]:
    """Run one call per node at once; each failure stays that node's (the others go on)."""
    got = await asyncio.gather(*calls, return_exceptions=True)
    out: list[NodeOutcome[T]] = []
    for rank, (name, res) in enumerate(zip(names, got, strict=True), start=first_rank):
        if isinstance(res, BaseException):
            if not isinstance(res, Exception):
                raise res  # KeyboardInterrupt, CancelledError: not a node's failure
            out.append(NodeOutcome(name, rank, error=res))
        else:
            out.append(NodeOutcome(name, rank, result=res))
    return out


class GroupControl:
    """Deploy, start, stop, restart and status of a group, one RunControl per node.

    Node 0 holds the checkpoints: it is stopped first (its rank 0 writes the stop's checkpoint)
    and a config push is checked for resume against its checkpoint only. Nodes run torchrun
    under tmux without the per-node supervisor (`RunStarter.start_node`): a node
    restarted alone cannot rejoin the group's static rendezvous.
    """

    def __init__(self, group: GroupConfig, transports: Sequence[Transport]) -> None:
        if len(transports) != group.nnodes:
            raise ValueError(
                f"group {group.name!r}: {len(transports)} transports, {group.nnodes} nodes"
            )
        self.group = group
        self.controls = [RunControl(t, h) for t, h in zip(transports, group.nodes, strict=True)]

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.group.hosts

    async def statuses(self, *, setup_errors: bool = False) -> list[RunStatus]:
        return list(
            await asyncio.gather(*(c.status(setup_errors=setup_errors) for c in self.controls))
        )

    async def reachable_statuses(self, doing: str) -> list[RunStatus]:
        """Every node's status; HostUnreachable naming each unreachable node (`not DOING: ...`)
        when one is: a group command acts on all nodes or on none."""
        sts = await self.statuses(setup_errors=True)
        down = [st for st in sts if st.state == "unreachable"]
        if down:
            raise HostUnreachable(
                f"group {self.name!r}: not {doing}: "
                + "; ".join(st.message or f"{st.host}: unreachable" for st in down)
            )
        return sts

    async def view(self) -> tuple[GroupView, list[RunStatus]]:
        sts = await self.statuses()
        return group_state(
            self.name, [NodeReport.from_status(st, i) for i, st in enumerate(sts)]
        ), sts

    async def deploy(
        self,
        *,
        config: Path | None,
        release: Release | None = None,
        progress: Progress | None = None,
        fresh: bool = False,
        break_stale_lock: bool = False,
        memory_check: bool = True,
        import_check: bool = True,
        resume_checked: bool = False,
    ) -> list[NodeOutcome[DeployResult]]:
        """The same release and run config on every node, at once; a node that fails is that
        node's error (the others are still deployed and reported). The config push is checked
        for resume on node 0 (the checkpoints are there; the other nodes have none to check)."""
        from dflashctl.releases.release import build_release

        rel = release or build_release()

        def one(rank: int, ctl: RunControl) -> Awaitable[DeployResult]:
            return deploy(
                ctl.transport,
                ctl.host,
                config=config,
                progress=progress,
                release=rel,
                fresh=fresh,
                resume_checked=resume_checked or rank > 0,
                break_stale_lock=break_stale_lock,
                memory_check=memory_check,
                import_check=import_check,
            )

        return await _each(self.hosts, [one(i, c) for i, c in enumerate(self.controls)])

    def _refuse_mixed(self, sts: Sequence[RunStatus]) -> tuple[str, str | None]:
        """(release, config hash) shared by every node, or ControlError naming the nodes."""
        g = self.name
        missing = [st.host for st in sts if st.release is None]
        if missing:
            raise ControlError(
                f"group {g!r}: nothing deployed on {', '.join(missing)}; run `dflashctl deploy {g}`"
            )
        no_config = [st.host for st in sts if st.deployed_config_hash is None]
        if no_config:
            raise ControlError(
                f"group {g!r}: no valid run/config.toml on {', '.join(no_config)}; "
                f"`dflashctl deploy {g} --config PATH` puts one on every node"
            )
        for what, values in (
            ("releases", [st.release for st in sts]),
            ("config hashes", [st.deployed_config_hash for st in sts]),
        ):
            if len(set(values)) > 1:
                pairs = ", ".join(f"{st.host} {v}" for st, v in zip(sts, values, strict=True))
                raise ControlError(
                    f"group {g!r}: the nodes' {what} differ ({pairs}); "
                    f"`dflashctl deploy {g}` puts the same on every node"
                )
        return sts[0].release or "", sts[0].deployed_config_hash

    def _refuse_measuring(self, sts: Sequence[RunStatus], doing: str) -> None:
        """MeasureInProgress naming the first node where a measure runs (`not DOING: ...`)."""
        for st in sts:
            if st.measure is not None:
                err = measure_refusal(st.measure, st.host, "the group's run")
                raise MeasureInProgress(f"group {self.name!r}: not {doing}: {err}")

    async def _node_procs(self) -> list[int]:
        """Ranks per node: the entries of topology.drafter_devices in its deployed config."""
        from dflashctl.config.runconfig import drafter_device_count

        texts = await asyncio.gather(*(c.deployed_config() for c in self.controls))
        return [drafter_device_count(t) for t in texts]

    async def start(
        self,
        *,
        fresh: bool = False,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Progress | None = None,
    ) -> GroupStartResult:
        """Start torchrun on every node (node i with `--node-rank i`), then wait for node 0.

        Refused (nothing started) when a node is unreachable, some but not all nodes run, a
        measure runs on one (MeasureInProgress), or the nodes' release or config differ. Every
        node's session is started at once (the static rendezvous waits for all of them); then
        node 0's trainer is waited for up to `wait_s` (it is past its setup only once every
        rank joined), and a node whose torchrun exited is a StartFailed naming that node.
        """
        g = self.name
        sts = await self.reachable_statuses("starting")
        live = [st.host for st in sts if st.state in LIVE_NODE_STATES]
        if len(live) < len(sts):  # read in the same round trip as each node's status
            self._refuse_measuring(sts, "starting")
        release, config_hash = self._refuse_mixed(sts)
        if len(live) == len(sts):
            return GroupStartResult(g, False, [], release, config_hash, None)
        if live:
            idle = [st.host for st in sts if st.host not in live]
            raise ControlError(
                f"group {g!r}: running on {', '.join(live)} but not on {', '.join(idle)}; "
                f"`dflashctl stop {g}` first, then start it whole"
            )
        launches = group_launches(self.group, await self._node_procs(), fresh=fresh, resume=resume)
        await self._port_free(progress)
        outcomes = await _each(
            self.hosts,
            [
                ctl.starter.start_node(NodeCommand(x.argv, x.env, "--fresh" in x.program), wait_s=0)
                for ctl, x in zip(self.controls, launches, strict=True)
            ],
        )
        failed = [o for o in outcomes if not o.ok]
        if failed:
            await self._stop_started([o for o in outcomes if o.ok])
            raise ControlError("; ".join(o.error_line() for o in failed))
        results = [o.result for o in outcomes if o.result is not None]
        if wait_s <= 0:
            return GroupStartResult(g, True, results, release, config_hash, None)
        node0 = self.controls[0]
        if progress:
            progress(f"{g}: waiting up to {wait_s:g} s for node 0 ({node0.host.name})'s setup")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        ready = await node0.starter.wait_started(sts[0].log_lines, wait_s)
        took = loop.time() - t0
        after = await self.statuses()
        dead = [(i, st) for i, st in enumerate(after) if st.state not in LIVE_NODE_STATES]
        if dead:
            view = group_state(g, [NodeReport.from_status(st, i) for i, st in enumerate(after)])
            first = view.failed
            i = first.node_rank if first is not None else dead[0][0]
            err = await self.controls[i].starter.start_failure(sts[i].log_lines, took)
            await self._stop_started([NodeOutcome(st.host, j) for j, st in enumerate(after)])
            raise StartFailed(f"group {g!r}: node {i}: {err}")
        return GroupStartResult(g, True, results, release, config_hash, ready == "ready", took)

    async def _port_free(self, progress: Progress | None) -> None:
        """Node 0's rendezvous port must be free: torchrun there listens on it."""
        node0, port = self.controls[0], self.group.rdzv_port
        res = await node0.transport.run(
            port_free_argv(node0.host.python, port, PORT_WAIT_S), timeout=PORT_WAIT_S + 30
        )
        if not res.ok:
            raise ControlError(
                f"group {self.name!r}: node 0 ({node0.host.name}) rendezvous port {port} is "
                f"in use after {PORT_WAIT_S:g} s ({res.stdout.strip() or res.error_line()}): a "
                f"torchrun still exiting, or another service; choose rdzv_port in [groups."
                f"{self.name}] if it stays taken"
            )

    async def _stop_started(self, started: Sequence[NodeOutcome[T]]) -> None:
        """After a failed group start: end the nodes that did start (they would wait for the
        rendezvous until its timeout)."""
        await asyncio.gather(
            *(self.controls[o.node_rank].stopper.stop_node(10.0) for o in started),
            return_exceptions=True,
        )

    async def stop(self, timeout: float = 120.0) -> GroupStopResult:
        """Node 0's ranks get SIGINT first (rank 0 writes the stop's checkpoint), then every
        other node's; the stop is agreed in the step's reduce, so all ranks stop at the same
        step. Then node 0 is waited for (its checkpoint line, then its torchrun's exit, which
        meets the others at torchrun's exit barrier) and the other nodes the same way; a
        session is ended only after that (or at the time limits)."""
        await self.reachable_statuses("stopping")
        others = self.controls[1:]

        async def signal_others() -> None:
            # Every rank is signalled, not only node 0's: each then records a stop of its own
            # (a rank that stopped only on the reduced flag exited failed before the trainer
            # agreed the stop's checkpoint across ranks, and an older release still does).
            await asyncio.gather(
                *(c.stopper.interrupt_workers() for c in others), return_exceptions=True
            )

        first = await self.controls[0].stopper.stop_node(
            timeout, settle_s=SETTLE_S, after_interrupt=signal_others
        )
        rest = await _each(
            self.hosts[1:],
            [
                c.stopper.stop_node(min(timeout, 60.0), settle_s=SETTLE_S, interrupt=False)
                for c in others
            ],
            first_rank=1,
        )
        errors = [o.error_line() for o in rest if not o.ok]
        if errors:
            raise ControlError(
                f"group {self.name!r}: node 0 {first.summary()}; " + "; ".join(errors)
            )
        return GroupStopResult(
            self.name, [first, *(o.result for o in rest if o.result is not None)]
        )

    async def restart(
        self,
        *,
        fresh: bool = False,
        config: Path | None = None,
        stop_timeout: float = 120.0,
        progress: Progress | None = None,
        release: Release | None = None,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
    ) -> GroupRestartResult:
        """Push the config and release to every node, stop the group, start it.

        The push is checked against node 0's checkpoint first (the one a resume loads, whose
        state reaches every rank by broadcast): a config that cannot resume it is refused unless
        `fresh`, before anything is stopped. A node whose deploy fails stops the restart there
        (the group keeps running as it was).
        """
        from dflashctl.config.runconfig import config_hash_of_file, validate_config
        from dflashctl.releases.release import build_release
        from dflashctl.releases.resume import check_config_push

        path = config if config is not None else self.group.nodes[0].run_config
        node0 = self.controls[0]
        if path is not None:
            validate_config(path)
            check = await check_config_push(
                node0.transport, node0.host, path, fresh=fresh, resume=resume
            )
            for note in check.notes:
                if progress:
                    progress(note)
        old = await self.statuses(setup_errors=True)
        self._refuse_measuring(old, "restarting")  # before anything is deployed or stopped
        deployed = await self.deploy(
            config=path,
            release=release or build_release(),
            progress=progress,
            resume_checked=True,
        )
        failed = [o.error_line() for o in deployed if not o.ok]
        if failed:
            raise ControlError(
                f"group {self.name!r}: not restarted (deploy failed): " + "; ".join(failed)
            )
        stopped = await self.stop(stop_timeout)
        started = await self.start(fresh=fresh, resume=resume, wait_s=wait_s, progress=progress)
        return GroupRestartResult(
            self.name,
            [o.result for o in deployed if o.result is not None],
            stopped,
            started,
            old[0].deployed_config_hash,
            config_hash_of_file(path) if path is not None else old[0].deployed_config_hash,
        )


@dataclass(frozen=True)
class GroupRestartResult:
    group: str
    deploys: list[DeployResult]
    stop: GroupStopResult
    start: GroupStartResult
    old_config_hash: str | None
    new_config_hash: str | None


def group_config_path(group: GroupConfig, override: Path | None) -> Path | None:
    """The one run config a group's nodes get: `override`, else node 0's `run_config`. Nodes
    whose own `run_config` is a different config (by hash) are refused, naming them: one group
    trains one config."""
    from dflashctl.config.runconfig import config_hash_of_file
    from dflashctl.errors import UsageError

    if override is not None:
        return override
    paths = [(n.name, n.run_config) for n in group.nodes]
    first = paths[0][1]
    if all(p == first for _, p in paths):
        return first
    hashes = [(name, config_hash_of_file(p) if p is not None else None) for name, p in paths]
    if len({h for _, h in hashes}) > 1:
        listed = ", ".join(f"{name} {h or '(none)'}" for name, h in hashes)
        raise UsageError(
            f"group {group.name!r}: the nodes' run_config differ ({listed}); give them one "
            f"file, or pass --config PATH"
        )
    return first
