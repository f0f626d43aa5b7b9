"""A group's nodes as host handles, node 0 first (what the TUI and the CLI hold per group)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING

from dflashctl.groups.state import GroupView, NodeReport, group_state

if TYPE_CHECKING:
    from dflashctl.config.inventory import GroupConfig
    from dflashctl.fleet import HostHandle


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
        statuses = await asyncio.gather(*(h.control.status() for h in self.nodes))
        return [NodeReport.from_status(st, i) for i, st in enumerate(statuses)]

    async def view(self) -> GroupView:
        return group_state(self.name, await self.reports())
