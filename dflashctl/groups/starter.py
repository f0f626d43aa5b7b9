"""Starting a group: every node's supervisor and torchrun at once, node 0 hosting the rendezvous.

Refused (nothing started) when a node is unreachable, some but not all nodes run, a measure
runs on one, or the nodes' release or config differ.
"""

from __future__ import annotations

import asyncio
import posixpath
import secrets
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, TypeVar

from dflashctl.groups.launch import group_launches, supervisor_args
from dflashctl.groups.results import GroupStartResult, NodeOutcome, each_node
from dflashctl.groups.state import LIVE_NODE_STATES, NodeReport, group_state
from dflashctl.remote.transport import HostUnreachable
from dflashctl.runs.control import RunControl
from dflashctl.runs.service import (
    DEFAULT_START_WAIT_S,
    ControlError,
    JobInProgress,
    MeasureInProgress,
    StartFailed,
    job_refusal,
    measure_refusal,
)
from dflashctl.runs.snapshot import RunStatus
from dflashctl.runs.starter import NodeCommand

if TYPE_CHECKING:
    from dflashctl.config.inventory import GroupConfig

T = TypeVar("T")
Progress = Callable[[str], None]
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


def shared_deployment(group: str, sts: Sequence[RunStatus]) -> tuple[str, str | None]:
    """(release, config hash) shared by every node of `group`, or ControlError naming the
    nodes with nothing deployed, no run config, or a release or config unlike the others'."""
    g = group
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


def failed_node(group: str, after: Sequence[RunStatus]) -> int:
    """The node a failed group start is named by (statuses read after it): the one that failed
    first by the trainer's record, else by every supervisor's, else the first that ended
    (node 0 when none did)."""
    view = group_state(group, [NodeReport.from_status(st, i) for i, st in enumerate(after)])
    if view.failed is not None:
        return view.failed.node_rank
    if view.history:
        return view.history[-1].first.node_rank
    dead = [i for i, st in enumerate(after) if st.state not in LIVE_NODE_STATES]
    return dead[0] if dead else 0


class GroupStarter:
    """Starts a group's nodes through their RunControls (node 0 first in every list)."""

    def __init__(self, group: GroupConfig, controls: Sequence[RunControl]) -> None:
        self.group = group
        self.controls = list(controls)

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

    def refuse_measuring(self, sts: Sequence[RunStatus], doing: str) -> None:
        """MeasureInProgress (JobInProgress) naming the first node where a measure (an eval or a
        gate) runs (`not DOING: ...`)."""
        for st in sts:
            if st.measure is not None:
                err = measure_refusal(st.measure, st.host, "the group's run")
                raise MeasureInProgress(f"group {self.name!r}: not {doing}: {err}")
            if st.job is not None:
                busy = job_refusal(st.job, st.host, "the group's run")
                raise JobInProgress(f"group {self.name!r}: not {doing}: {busy}")

    async def _node_procs(self) -> list[int]:
        """Ranks per node: the entries of topology.drafter_devices in its deployed config; the
        data its config names checked on every node first (`refuse_missing_data`)."""
        from dflashctl.config.runconfig import drafter_device_count

        texts = await asyncio.gather(*(c.deployed_config() for c in self.controls))
        await self.refuse_missing_data(texts)
        return [drafter_device_count(t) for t in texts]

    async def refuse_missing_data(self, texts: Sequence[str]) -> None:
        """ControlError, one line per node and path, when a node lacks the token store or
        target model its deployed config names (and the trainer would not build it)."""
        from dflashctl.config.runconfig import load_config_text
        from dflashctl.groups.preflight import check_argv, data_needs, problems

        needs = [
            data_needs(load_config_text(t), posixpath.dirname(c.layout.config))
            for c, t in zip(self.controls, texts, strict=True)
        ]
        answers = await asyncio.gather(
            *(c.transport.run(check_argv(n)) for c, n in zip(self.controls, needs, strict=True))
        )
        lines: list[str] = []
        for ctl, need, res in zip(self.controls, needs, answers, strict=True):
            if not res.ok:
                lines.append(f"{ctl.host.name}: checking its data: {res.error_line()}")
                continue
            lines += problems(ctl.host.name, need, res.stdout)
        if lines:
            raise ControlError(
                "\n".join([f"group {self.name!r}: not starting: data missing on a node", *lines])
            )

    async def start(
        self,
        *,
        fresh: bool = False,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Progress | None = None,
    ) -> GroupStartResult:
        """Start every node's supervisor and torchrun (c10d, node 0 hosting the rendezvous),
        then wait for node 0.

        Refused (nothing started) when a node is unreachable, some but not all nodes run, a
        measure runs on one (MeasureInProgress), the nodes' release or config differ, or a node
        lacks the data its config names. Every node's session is started at once (the
        rendezvous waits for all of them); then node 0's trainer is waited for up to `wait_s`
        (it is past its setup only once every rank joined), and a node that ended is a
        StartFailed naming that node with its own error line.
        """
        g = self.name
        sts = await self.reachable_statuses("starting")
        live = [st.host for st in sts if st.state in LIVE_NODE_STATES]
        if len(live) < len(sts):  # read in the same round trip as each node's status
            self.refuse_measuring(sts, "starting")
        release, config_hash = shared_deployment(g, sts)
        if len(live) == len(sts):
            return GroupStartResult(g, False, [], release, config_hash, None)
        if live:
            idle = [st.host for st in sts if st.host not in live]
            raise ControlError(
                f"group {g!r}: running on {', '.join(live)} but not on {', '.join(idle)}; "
                f"`dflashctl stop {g}` first, then start it whole"
            )
        launch_id = f"{g}-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{secrets.token_hex(3)}"
        launches = group_launches(
            self.group, await self._node_procs(), fresh=fresh, resume=resume, launch_id=launch_id
        )
        await self._port_free(progress)
        outcomes = await each_node(
            self.hosts,
            [
                ctl.starter.start_node(
                    NodeCommand(
                        x.argv,
                        x.env,
                        "--fresh" in x.program,
                        supervisor_args(self.group, x.node_rank),
                    ),
                    wait_s=0,
                )
                for ctl, x in zip(self.controls, launches, strict=True)
            ],
        )
        failed = [o for o in outcomes if not o.ok]
        if failed:
            await self.stop_started([o for o in outcomes if o.ok])
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
        dead = [i for i, st in enumerate(after) if st.state not in LIVE_NODE_STATES]
        if dead or ready in ("exited", "restarting"):
            # a node ended, or the group already restarted: a failed start, named by the node
            # that failed first
            i = failed_node(g, after)
            err = await self.controls[i].starter.start_failure(sts[i].log_lines, took)
            await self.stop_started([NodeOutcome(st.host, j) for j, st in enumerate(after)])
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

    async def stop_started(self, started: Sequence[NodeOutcome[T]]) -> None:
        """After a failed group start: end the nodes that did start (they would wait for the
        rendezvous until its timeout)."""
        await asyncio.gather(
            *(self.controls[o.node_rank].stopper.stop_node(10.0) for o in started),
            return_exceptions=True,
        )
