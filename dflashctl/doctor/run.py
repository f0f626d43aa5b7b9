"""`dflashctl doctor` against one host: read the node and the container, judge, return checks.

Quick checks (what deploy and start run, cached per release and container): container,
gpu-nodes, cgroup, driver, torch, shm, memory. The full doctor adds the checkpoint disk check
(the release's memory estimate) and the device self-test (`python -m trainer.doctor` from the
release, on the pushed run config).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from dflashctl.config.inventory import HostConfig
from dflashctl.doctor.checks import (
    Check,
    check_cgroup,
    check_container,
    check_driver,
    check_limits,
    check_nodes,
    check_torch,
)
from dflashctl.doctor.facts import ContainerFacts, NodeFacts, parse_container, parse_node
from dflashctl.doctor.needs import Needs, needs_of, needs_without_config
from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.remote.doctor_probe import container_probe_argv, node_probe_argv
from dflashctl.remote.transport import NodeCommands, Transport

QUICK = ("container", "gpu-nodes", "cgroup", "driver", "torch", "shm", "memory")


class DoctorError(DflashctlError):
    """doctor could not read what it judges (one line naming the host)."""

    exit_code = ExitCode.FAILED


@dataclass(frozen=True)
class HostReport:
    host: str
    checks: list[Check]
    node: NodeFacts | None = None
    container: ContainerFacts | None = None

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def failed(self) -> list[Check]:
        return [c for c in self.checks if c.status == "fail"]


def host_needs(host: HostConfig, node: NodeFacts, config: Path | None = None) -> Needs:
    """What `config` (default: the host's run_config) needs; every node GPU without one."""
    path = config or host.run_config
    if path is None:
        return needs_without_config(node.gpus)
    from dflashctl.config.runconfig import validate_config

    return needs_of(validate_config(path))


async def read_node(transport: Transport, host: HostConfig) -> NodeFacts:
    if not isinstance(transport, NodeCommands):
        raise DoctorError(f"{host.name}: this transport cannot run commands on the node")
    res = await transport.run_host(node_probe_argv(host.ctid), timeout=60)
    return parse_node(res.stdout, res.rc)


async def read_container(transport: Transport, host: HostConfig) -> ContainerFacts:
    res = await transport.run(container_probe_argv(host.workdir, host.python), timeout=180)
    return parse_container(res.stdout)


async def quick_checks(
    transport: Transport, host: HostConfig, config: Path | None = None
) -> HostReport:
    state = await transport.container_state()
    node = await read_node(transport, host)
    first = check_container(state, host.ctid, node.config, node.config_error)
    if first.status == "fail":
        rest = [Check(name, "skipped", "the container check failed") for name in QUICK[1:]]
        return HostReport(host.name, [first, *rest], node)
    ct = await read_container(transport, host)
    needs = host_needs(host, node, config)
    checks = [
        first,
        check_nodes(needs, node, ct, host.ctid),
        check_cgroup(needs, node, ct, host.ctid),
        check_driver(needs, node, ct),
        check_torch(needs, ct, host.name, host.python),
        *check_limits(needs, ct, host.ctid),
    ]
    return HostReport(host.name, checks, node, ct)


async def full_checks(transport: Transport, host: HostConfig) -> HostReport:
    report = await quick_checks(transport, host)
    if report.container is None:
        skipped = [Check(n, "skipped", "the container check failed") for n in ("disk", "self-test")]
        return HostReport(host.name, [*report.checks, *skipped], report.node)
    disk = await disk_check(transport, host, report.container)
    test = await self_test(transport, host, report.container)
    return HostReport(host.name, [*report.checks, disk, test], report.node, report.container)


async def disk_check(transport: Transport, host: HostConfig, ct: ContainerFacts) -> Check:
    """Checkpoints x retention against free disk: the release's own memory estimate."""
    from dflashctl.releases.preflight import judge_disk, parse_probe_output
    from dflashctl.remote.probe import memory_argv

    free = "unknown" if ct.free_bytes is None else f"{ct.free_bytes / 1024**3:.1f} GiB free"
    if ct.current is None or host.run_config is None:
        why = "no release deployed" if ct.current is None else "no run_config in hosts.toml"
        return Check("disk", "warn", f"{free}; checkpoint size unknown ({why})")
    res = await transport.run(
        memory_argv(host.python, host.workdir, ct.current, None),
        input=host.run_config.read_bytes(),
        timeout=300,
    )
    probe = parse_probe_output(res.stdout)
    rep = probe.get("report") if probe else None
    if probe is None or not isinstance(rep, dict):
        return Check("disk", "warn", f"{free}; the memory estimate failed: {res.error_line()}")
    verdict = judge_disk(host.name, host.run_dir, probe, rep)
    prefix = f"{host.name}: "
    if verdict.failures:
        line = verdict.failures[0].removeprefix(prefix)
        detail, _, fix = line.rpartition("; ")
        return Check("disk", "fail", detail, (fix,))
    note = (verdict.notes or [""])[0].removeprefix(prefix)
    if note.startswith("warning: "):
        return Check("disk", "warn", note.removeprefix("warning: "))
    return Check("disk", "ok", note)


async def self_test(transport: Transport, host: HostConfig, ct: ContainerFacts) -> Check:
    """`python -m trainer.doctor --json` from the current release on the pushed run config."""
    from dflashctl.remote.layout import RemoteLayout

    if ct.current is None:
        return Check("self-test", "skipped", f"no release deployed (dflashctl deploy {host.name})")
    lay = RemoteLayout(host.workdir)
    script = (
        'cd "$1" && [ -f "$2" ] || { echo "no run config at $2" >&2; exit 3; }; '
        'PYTHONPATH="$3" exec "$4" -m trainer.doctor --config "$2" --json'
    )
    argv = ["sh", "-c", script, "doctor-self-test", host.workdir, lay.config]
    argv += [lay.release_dir(ct.current), host.python]
    res = await transport.run(argv, timeout=900)
    if res.rc == 3:
        return Check("self-test", "skipped", f"no run config pushed ({lay.config})")
    try:
        rep = json.loads(res.stdout)
    except ValueError:
        return Check("self-test", "fail", f"trainer.doctor: {res.error_line()}")
    stages = rep.get("stages", [])
    bad = [s for s in stages if s.get("status") == "fail"]
    warned = [s for s in stages if s.get("status") == "warn"]
    ran = sum(s.get("status") != "skipped" for s in stages)
    if bad:
        what = "; ".join(f"{s['device']} {s['stage']}: {s['detail']}" for s in bad)
        return Check("self-test", "fail", what)
    if warned:
        what = "; ".join(f"{s['device']} {s['stage']}: {s['detail']}" for s in warned)
        return Check("self-test", "warn", what)
    return Check(
        "self-test", "ok", f"trainer.doctor: {ran} stages ran, {len(stages) - ran} skipped"
    )
