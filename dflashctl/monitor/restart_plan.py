"""The restart plan (the r key): the unified diff between the deployed and the local run config,
and whether the restart can resume or must start fresh (and which keys force that)."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from dflashctl.releases.resume import CheckpointConfig


@dataclass(frozen=True, slots=True)
class RestartPlan:
    """What `r` would do: the diff, and resume vs. fresh with the keys that decide it."""

    diff: str
    fresh: bool
    critical_keys: tuple[str, ...] = ()
    error: str | None = None
    """Set when the local config is invalid: the restart is refused and this says why."""

    @property
    def changed(self) -> bool:
        return bool(self.diff)

    @property
    def verdict(self) -> str:
        if self.error:
            return f"cannot restart: {self.error}"
        if self.fresh:
            return (
                "start FRESH (checkpoints set aside): resume-critical keys changed: "
                + ", ".join(self.critical_keys)
            )
        return "resume from the latest checkpoint (no resume-critical key changed)"


class NotAsked(enum.Enum):
    """`plan_restart` was not told which checkpoint a resume would load."""

    NOT_ASKED = enum.auto()


def plan_restart(
    deployed: str,
    local_path: Path,
    checkpoint: CheckpointConfig | NotAsked | None = NotAsked.NOT_ASKED,
) -> RestartPlan:
    """Decide resume vs. fresh with the same rule `RunControl.restart` enforces.

    `checkpoint` is what `RunControl.checkpoint_config()` found (a CheckpointConfig, or None:
    nothing to resume): the new config is compared with the config saved in the checkpoint a
    resume would load, through `dflashctl.releases.resume` (which defers to
    `trainer.config.resume_critical_changes`), so the modal's verdict and the service's refusal
    can never disagree. Without it (a control that cannot tell), the deployed config stands in.
    An invalid local config refuses the restart and names the problem.
    """
    from dflashctl.config.runconfig import (
        RunConfigError,
        config_diff,
        read_config_text,
        resume_breaking_changes,
        validate_config,
    )
    from dflashctl.releases.resume import breaking_keys

    try:
        local = read_config_text(local_path)
    except RunConfigError as exc:
        return RestartPlan(diff="", fresh=False, error=str(exc))
    diff = config_diff(
        deployed, local, old_name="deployed: run/config.toml", new_name=f"local: {local_path}"
    )
    try:
        validate_config(local_path)
    except RunConfigError as exc:
        return RestartPlan(diff=diff, fresh=False, error=str(exc).replace("\n", " "))
    if checkpoint is NotAsked.NOT_ASKED:
        keys = tuple(resume_breaking_changes(deployed, local_path)) if deployed else ()
    elif checkpoint is None or checkpoint.config is None:
        keys = ()  # no readable checkpoint: there is nothing a fresh start would set aside
    else:
        try:
            keys = tuple(breaking_keys(checkpoint.config, local_path))
        except RunConfigError as exc:
            return RestartPlan(diff=diff, fresh=False, error=str(exc).replace("\n", " "))
    return RestartPlan(diff=diff, fresh=bool(keys), critical_keys=keys)
