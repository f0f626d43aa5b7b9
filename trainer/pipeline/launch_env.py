"""Where this process sits in the launch, from its environment (torch-free): the global rank
and the node's index, in the inventory's order on a dflashctl group node."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

NODE_RANK_ENV = "DFLASH_NODE_RANK"
"""Set by dflashctl on each node of a group: the node's index in the inventory's order."""


def node_rank(env: Mapping[str, str] | None = None) -> int | None:
    """This node's index in the group as dflashctl launched it (None: not a dflashctl group)."""
    value = (os.environ if env is None else env).get(NODE_RANK_ENV)
    return int(value) if value is not None and value.isdigit() else None


RANK_BASE_ENV = "DFLASH_RANK_BASE"
"""Set by dflashctl on each node of a group: the global rank of the node's first process (the
processes of the nodes before it in the inventory's order)."""


def launch_rank(env: Mapping[str, str] | None = None) -> int:
    """This process's global rank in the launch.

    torchrun's RANK, except on a dflashctl group node: DFLASH_RANK_BASE + LOCAL_RANK (without
    it, node rank x LOCAL_WORLD_SIZE + LOCAL_RANK), the inventory's order. torchrun's c10d rendezvous numbers the nodes by sorting
    their (address, pid) descriptors, so its RANK 0 may be on any node, and a restarted agent
    (a higher pid) may change places; node 0 holds the run's checkpoints, so its first process
    is global rank 0 whatever c10d decided."""
    env = os.environ if env is None else env
    node = node_rank(env)
    if node is None:
        return int(env.get("RANK", "0"))
    local = int(env.get("LOCAL_RANK", "0"))
    base = env.get(RANK_BASE_ENV, "")
    if base.isdigit():
        return int(base) + local
    return node * int(env.get("LOCAL_WORLD_SIZE", "1")) + local


LAUNCH_ID_ENV = "DFLASH_LAUNCH_ID"
"""Set by dflashctl per `start` of a group: one id for every attempt of that launch."""
LAUNCH_MARK = ".launch-id"  # in RUN: the launch whose first attempt chose its checkpoint


def repeated_launch(run_dir: Path, env: Mapping[str, str] | None = None) -> bool:
    """True when this launch (DFLASH_LAUNCH_ID) already chose its checkpoint in `run_dir`: a
    worker group that torchrun restarted with the same argv. Its `--fresh` (archive the
    checkpoints) or explicit `--resume` was the first attempt's to apply; a restart that applied
    it again would archive, or go back past, the checkpoints the group wrote since."""
    token = (os.environ if env is None else env).get(LAUNCH_ID_ENV, "")
    if not token:
        return False
    try:
        return (run_dir / LAUNCH_MARK).read_text().strip() == token
    except OSError:
        return False


def mark_launch(run_dir: Path, env: Mapping[str, str] | None = None) -> None:
    """Record that this launch chose its checkpoint (global rank 0, after the choice)."""
    token = (os.environ if env is None else env).get(LAUNCH_ID_ENV, "")
    if not token:
        return
    tmp = run_dir / f".{LAUNCH_MARK}.{os.getpid()}"
    try:
        tmp.write_text(token + "\n")
        os.replace(tmp, run_dir / LAUNCH_MARK)
    except OSError:
        tmp.unlink(missing_ok=True)
