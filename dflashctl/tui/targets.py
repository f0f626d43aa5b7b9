"""What the app shows and what its keys act on.

`tui_hosts` / `tui_groups`: the hosts and groups the command line and the inventory ask for.
`current_host` / `current_group`: the host or group under the keys, from the screen stack.
`refusal`: why a key that acts on one host does not act here (a group's row, a node of a group).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from textual.screen import Screen

from dflashctl.config.inventory import GroupConfig, Inventory
from dflashctl.tui.screens.fleet import FleetScreen
from dflashctl.tui.screens.group import GroupScreen

__all__ = ["current_group", "current_host", "refusal", "tui_groups", "tui_hosts"]


def tui_hosts(inventory: Inventory, names: Sequence[str]) -> list[str]:
    """The hosts to follow for `names` (hosts or groups; none: every host), a group's nodes in
    rank order."""
    if not names:
        return list(inventory.hosts)
    out: list[str] = []
    for target in inventory.resolve_targets(names):
        for host in target.hosts if isinstance(target, GroupConfig) else (target.name,):
            if host not in out:
                out.append(host)
    return out


def tui_groups(inventory: Inventory, hosts: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """The inventory's groups whose every node is followed (a group shown in part would show a
    state its other nodes could contradict)."""
    shown = set(hosts)
    return {g.name: g.hosts for g in inventory.groups.values() if set(g.hosts) <= shown}


def current_host(screens: Sequence[Screen[object]]) -> str | None:
    """The host the keys act on: the top host screen's, or the highlighted row of the fleet or
    a group's screen (None on a group's own row)."""
    for screen in reversed(screens):
        host = getattr(screen, "host", None)
        if isinstance(host, str):
            return host
        if isinstance(screen, FleetScreen | GroupScreen):
            return screen.selected_host()
    return None


def current_group(screens: Sequence[Screen[object]]) -> str | None:
    """The group under the keys: a group's screen, or the fleet's highlighted group row."""
    for screen in reversed(screens):
        if isinstance(screen, GroupScreen):
            return screen.group
        if isinstance(screen, FleetScreen):
            return screen.selected_group()
    return None


def refusal(
    host: str | None, group: str | None, groups: Mapping[str, Sequence[str]], verb: str | None
) -> str | None:
    """Why a key that acts on one host does nothing here (None: it acts on `host`).

    No host: a group's own row (the group commands are the CLI's) or nothing highlighted.
    `verb` (restart, stop, deploy: a run command) on a node of a group: the group runs one
    torchrun across its nodes, and one node restarted or stopped alone would leave the others
    waiting at the rendezvous.
    """
    if host is None:
        if group is not None:
            return (
                f"{group} is a group: pick one of its nodes, or run "
                f"`dflashctl restart|stop|deploy {group}`"
            )
        return "no host selected"
    if verb is None:
        return None
    member = next((g for g, nodes in groups.items() if host in nodes), None)
    if member is None:
        return None
    rank = list(groups[member]).index(host)
    return (
        f"{host} is node {rank} of group {member}: `dflashctl {verb} {member}` acts on "
        "every node (one node alone would break the run)"
    )
