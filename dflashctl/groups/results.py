"""What a group command did: one outcome per node, and the group's start/stop/restart results."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from dflashctl.errors import DflashctlError
from dflashctl.releases.deploy import DeployResult
from dflashctl.runs.service import StartResult, StopResult

T = TypeVar("T")


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


async def each_node(
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


@dataclass(frozen=True)
class GroupRestartResult:
    group: str
    deploys: list[DeployResult]
    stop: GroupStopResult
    start: GroupStartResult
    old_config_hash: str | None
    new_config_hash: str | None
