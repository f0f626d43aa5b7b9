"""Run control, deploy, release, launch and transport errors share the one base and keep the
exit codes `dflashctl` has always given them."""

from __future__ import annotations

import pytest

from dflashctl.config.inventory import InventoryError
from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.groups.launch import LaunchError
from dflashctl.releases.deploy import DeployError, LockHeld
from dflashctl.releases.release import ReleaseError
from dflashctl.remote.ssh import HostSetupError
from dflashctl.remote.transport import (
    CommandTimeout,
    HostKeyError,
    HostUnreachable,
    TransportError,
)
from dflashctl.runs.service import ControlError, StartFailed


@pytest.mark.parametrize(
    ("cls", "code"),
    [
        (TransportError, ExitCode.FAILED),
        (CommandTimeout, ExitCode.FAILED),
        (HostUnreachable, ExitCode.UNREACHABLE),
        (HostKeyError, ExitCode.UNREACHABLE),
        (HostSetupError, ExitCode.USAGE),  # a local config problem, though also a transport one
        (ControlError, ExitCode.FAILED),
        (StartFailed, ExitCode.FAILED),
        (DeployError, ExitCode.FAILED),
        (LockHeld, ExitCode.FAILED),
        (ReleaseError, ExitCode.USAGE),
        (LaunchError, ExitCode.USAGE),
    ],
)
def test_each_error_has_the_base_and_its_exit_code(cls: type[DflashctlError], code: int) -> None:
    assert issubclass(cls, DflashctlError) and cls.exit_code == code


def test_the_older_bases_still_hold() -> None:
    assert issubclass(LaunchError, ValueError)
    assert issubclass(HostSetupError, InventoryError) and issubclass(HostSetupError, TransportError)
    held = LockHeld("pve-a: another deploy holds it", "me pid 1")
    assert (str(held), held.owner, held.hint) == (
        "pve-a: another deploy holds it",
        "me pid 1",
        None,
    )
