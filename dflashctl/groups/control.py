"""A group (a multi-node run) as one thing: deploy, start, stop, restart and status.

Every node is driven through its own RunControl; `groups.state` decides what the nodes'
reports mean, `groups.starter` starts them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dflashctl.groups.results import (
    GroupRestartResult,
    GroupStartResult,
    GroupStopResult,
    NodeOutcome,
    each_node,
)
from dflashctl.groups.starter import GroupStarter, Progress
from dflashctl.groups.state import GroupView, NodeReport, group_state
from dflashctl.releases.deploy import DeployResult, deploy
from dflashctl.remote.transport import Transport
from dflashctl.runs.control import RunControl
from dflashctl.runs.service import DEFAULT_START_WAIT_S, ControlError
from dflashctl.runs.snapshot import RunStatus

if TYPE_CHECKING:
    from dflashctl.config.inventory import GroupConfig
    from dflashctl.releases.release import Release

SETTLE_S = 60.0
"""After a group stop's checkpoint, how long each node's torchrun gets to exit by itself
(its agents meet at an exit barrier) before its session is ended."""


class GroupControl:
    """Deploy, start, stop, restart and status of a group, one RunControl per node.

    Node 0 holds the checkpoints: it is stopped first (its rank 0 writes the stop's checkpoint)
    and a config push is checked for resume against its checkpoint only. Each node runs its
    supervisor in front of torchrun (c10d rendezvous, `RunStarter.start_node`), with the
    group's one restart policy.
    """

    def __init__(self, group: GroupConfig, transports: Sequence[Transport]) -> None:
        if len(transports) != group.nnodes:
            raise ValueError(
                f"group {group.name!r}: {len(transports)} transports, {group.nnodes} nodes"
            )
        self.group = group
        self.controls = [RunControl(t, h) for t, h in zip(transports, group.nodes, strict=True)]
        self.starter = GroupStarter(group, self.controls)

    @property
    def name(self) -> str:
        return self.group.name

    @property
    def hosts(self) -> tuple[str, ...]:
        return self.group.hosts

    async def statuses(self, *, setup_errors: bool = False) -> list[RunStatus]:
        return await self.starter.statuses(setup_errors=setup_errors)

    async def reachable_statuses(self, doing: str) -> list[RunStatus]:
        return await self.starter.reachable_statuses(doing)

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

        return await each_node(self.hosts, [one(i, c) for i, c in enumerate(self.controls)])

    async def start(
        self,
        *,
        fresh: bool = False,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Progress | None = None,
    ) -> GroupStartResult:
        """`GroupStarter.start`: torchrun on every node at once, then wait for node 0."""
        return await self.starter.start(
            fresh=fresh, resume=resume, wait_s=wait_s, progress=progress
        )

    async def stop(self, timeout: float = 120.0) -> GroupStopResult:
        """Node 0's ranks get SIGINT first (rank 0 writes the stop's checkpoint), then every
        other node's; the stop is agreed in the step's reduce, so all ranks stop at the same
        step. Then node 0 is waited for (its checkpoint line, then its torchrun's exit, which
        meets the others at torchrun's exit barrier) and the other nodes the same way; a
        session is ended only after that (or at the time limits)."""
        sts = await self.reachable_statuses("stopping")
        # a node under its supervisor gets the C-c (it must know the stop is the operator's,
        # or it restarts the agent); a bare torchrun's ranks get the SIGINT themselves
        sup = [st.supervisor is not None for st in sts]
        others = self.controls[1:]

        async def signal_others() -> None:
            # Every rank is signalled, not only node 0's: each then records a stop of its own
            # (a rank that stopped only on the reduced flag exited failed before the trainer
            # agreed the stop's checkpoint across ranks, and an older release still does).
            await asyncio.gather(
                *(
                    c.stopper.interrupt_pane() if s else c.stopper.interrupt_workers()
                    for c, s in zip(others, sup[1:], strict=True)
                ),
                return_exceptions=True,
            )

        first = await self.controls[0].stopper.stop_node(
            timeout, settle_s=SETTLE_S, after_interrupt=signal_others, supervised=sup[0]
        )
        rest = await each_node(
            self.hosts[1:],
            [
                c.stopper.stop_node(
                    min(timeout, 60.0), settle_s=SETTLE_S, interrupt=False, supervised=s
                )
                for c, s in zip(others, sup[1:], strict=True)
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
        self.starter.refuse_measuring(old, "restarting")  # before anything is deployed or stopped
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
