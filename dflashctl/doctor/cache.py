"""deploy and start run the quick checks once per release and container: a pass is stamped in
the container (WORKDIR/doctor/<release>.ok, holding the node's driver version, so a driver
change there re-runs them); a failure refuses with the failing check's line and its fix."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from dflashctl.config.inventory import HostConfig
from dflashctl.doctor.checks import Check
from dflashctl.doctor.run import HostReport, quick_checks
from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.remote.doctor_probe import stamp_read_argv, stamp_write_argv
from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.transport import Transport


class DoctorRefused(DflashctlError):
    """A quick check failed: deploy/start refuse (the message is the check's line and fix)."""

    exit_code = ExitCode.FAILED


def refusal(host: str, check: Check) -> str:
    fixes = "".join(f"\n  fix: {line}" for line in check.fix)
    return f"{host}: doctor {check.name}: {check.detail}{fixes}"


def _stamp_text(report: HostReport) -> str:
    driver = report.node.driver if report.node is not None else None
    return f"driver {driver or 'none'}\n"


async def ensure_quick_checks(
    transport: Transport,
    host: HostConfig,
    release: str | None,
    config: Path | None,
    say: Callable[[str], None],
) -> None:
    """Run the quick checks unless they passed for `release` (None: the deployed one; nothing
    deployed: nothing to check) in this container already, judged on `config`."""
    if release is None:
        res = await transport.run(["readlink", RemoteLayout(host.workdir).current])
        release = res.stdout.strip().rsplit("/", 1)[-1] if res.ok else ""
        if not release:
            return
    got = await transport.run(stamp_read_argv(host.workdir, release))
    if got.ok and got.stdout.strip():
        from dflashctl.doctor.run import read_node

        node = await read_node(transport, host)
        if got.stdout == f"driver {node.driver or 'none'}\n":
            return
    report = await quick_checks(transport, host, config)
    bad = report.failed()
    if bad:
        raise DoctorRefused(
            "\n".join(refusal(host.name, c) for c in bad)
            + f"\n{host.name}: refused; `dflashctl doctor {host.name}` shows every check"
        )
    for c in report.checks:
        if c.status == "warn":
            say(f"{host.name}: doctor {c.name}: warning: {c.detail}")
    await transport.run(stamp_write_argv(host.workdir, release), input=_stamp_text(report).encode())
    say(f"{host.name}: doctor: quick checks passed ({', '.join(c.name for c in report.checks)})")
