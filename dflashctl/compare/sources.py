"""Which run a `dflashctl compare` argument names, and its status.log's lines.

    HOST         the newest run on the host (its run/status.log)
    HOST~N       the run N fresh starts before it (kpro6~1: the run before a --fresh start)
    GROUP[~N]    the group's run, read on node 0 (global rank 0 writes the status and Eval lines)
    PATH[~N]     a local copy: a run directory holding status.log, or the log itself (anything
                 with a '/': ./run-a, /data/runs/b.log); kept runs stay comparable after their
                 host was reused (`dflashctl logs HOST -n 1000000 > run-a.log`)

A run is what status.log holds between fresh starts (`dflashctl.compare.curves`); checkpoints
archived by `--fresh` (checkpoints.old-<ts>) hold no curve, so they are not a source.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from dflashctl.compare.curves import RunCurves, split_runs
from dflashctl.config.inventory import GroupConfig, HostConfig, Inventory
from dflashctl.errors import DflashctlError, ExitCode, UsageError
from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.transport import Transport
from trainer.events import PHASE_TEXTS, sanitize_for_terminal

SPEC = re.compile(r"^(?P<source>.+?)(?:~(?P<back>\d+))?$")
STATUS_LOG = "status.log"
# The lines a run's curves come from (status, Eval, the phases that split runs): the rest of a
# days-long status.log stays on the host.
KEEP = (
    "^(\\[[0-9]+m\\] step=|Eval: |"
    + "|".join(re.escape(PHASE_TEXTS[p]) for p in ("loading", "resuming", "starting"))
    + ")"
)


class CompareError(DflashctlError):
    """A run that cannot be read or does not exist (one line naming it)."""

    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class RunSpec:
    text: str  # as given
    source: str  # host, group or path
    back: int  # runs before the newest
    local: bool

    @property
    def where(self) -> str:
        return self.source


def parse_spec(text: str) -> RunSpec:
    m = SPEC.match(text.strip())
    if m is None or m.group("source").startswith("~"):
        raise UsageError(f"compare: {text!r} is not HOST[~N] or PATH[~N]")
    source = m.group("source")
    return RunSpec(text, source, int(m.group("back") or 0), "/" in source)


def local_log(spec: RunSpec) -> Path:
    path = Path(spec.source)
    if path.is_dir():
        path = path / STATUS_LOG
    if not path.is_file():
        raise CompareError(f"compare {spec.text}: no {path} (a run directory or its status.log)")
    return path


def read_local(spec: RunSpec) -> list[str]:
    path = local_log(spec)
    try:
        return path.read_text(encoding="utf-8", errors="replace").splitlines()
    except OSError as err:
        raise CompareError(f"compare {spec.text}: {path}: {err.strerror or err}") from None


def host_of(spec: RunSpec, inv: Inventory) -> HostConfig:
    """The host a spec reads (a group: its node 0)."""
    target = inv.resolve_targets([spec.source])[0] if inv.groups else inv.get(spec.source)
    return target.nodes[0] if isinstance(target, GroupConfig) else target


async def read_host(spec: RunSpec, transport: Transport, host: HostConfig) -> list[str]:
    """The host's status.log, only the lines curves are made of."""
    log = RemoteLayout(host.workdir).status_log
    res = await transport.run(
        ["grep", "-a", "-E", KEEP, log], timeout=max(120.0, host.command_timeout)
    )
    if res.rc == 1 and not res.stdout and not res.stderr:  # grep: nothing matched
        return []
    if not res.ok:
        raise CompareError(
            sanitize_for_terminal(f"compare {spec.text}: {host.name}: {res.error_line()}")
        )
    return res.stdout.splitlines()


@dataclass(frozen=True)
class Picked:
    """The run a spec names among the runs of its log."""

    spec: RunSpec
    curves: RunCurves
    index: int  # 1-based, oldest first
    count: int  # runs in the log


def pick(spec: RunSpec, lines: list[str]) -> Picked:
    runs = split_runs(lines)
    if not runs:
        raise CompareError(f"compare {spec.text}: {spec.where} holds no run with a status line yet")
    if spec.back >= len(runs):
        raise CompareError(
            f"compare {spec.text}: {spec.where} holds {len(runs)} run(s); ~{spec.back} is "
            f"before the first (~0 .. ~{len(runs) - 1})"
        )
    i = len(runs) - 1 - spec.back
    return Picked(spec, runs[i], i + 1, len(runs))
