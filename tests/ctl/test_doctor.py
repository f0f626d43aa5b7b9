"""`dflashctl doctor` on the LXC harness (issue 26, Deliver 2).

The "node" is this machine behind its own sshd, in a mount namespace where /proc/devices and
/proc/driver/nvidia are the test's (`parts.sshd(node_proc=...)`); `pct config` serves the
test's /etc/pve/lxc/CTID.conf; the container gets device nodes with the real nvidia majors by
`mknod` (or lacks them) and an `nvidia-smi` that replays captured outputs of real drivers
(fixtures/doctor, SOURCES.md). The container's real device cgroup allows majors 195 and 508,
so opening a node reaches the (absent) driver, as on a node whose rules are right.

Each broken case yields exactly its failing check and the fix line; the passthrough of the
healthy case passes. The container's torch is a CPU build, so with a GPU run config `torch`
fails in every case too (truthfully, with `dflashctl setup` as its fix); a CPU run config
passes every check. deploy and start run the quick checks once per release and container and
refuse with the failing check's line.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dflashctl.cli.main import main as cli_main
from tests.conftest import require_part
from tests.ctl import parts as P

REPO = Path(__file__).resolve().parents[2]
FIX = Path(__file__).resolve().parent / "fixtures" / "doctor"
UVM = 508
pytestmark = [pytest.mark.parts, pytest.mark.slow, pytest.mark.timeout(300)]

MOUNTS = "".join(
    f"lxc.mount.entry: /dev/{n} dev/{n} none bind,optional,create=file\n"
    for n in ("nvidia0", "nvidiactl", "nvidia-uvm", "nvidia-uvm-tools")
)
RULES = f"lxc.cgroup2.devices.allow: c 195:* rwm\nlxc.cgroup2.devices.allow: c {UVM}:* rwm\n"
NODES = (
    ("/dev/nvidia0", 195, 0),
    ("/dev/nvidiactl", 195, 255),
    ("/dev/nvidia-uvm", UVM, 0),
    ("/dev/nvidia-uvm-tools", UVM, 1),
)
FAKE_SMI = '#!/bin/sh\ncat /usr/local/bin/.smi-out\nexit "$(cat /usr/local/bin/.smi-rc)"\n'


@dataclass
class GpuNode:
    sshd: P.Sshd
    ct: P.Container
    proc: Path  # the node's /proc view (devices, nvidia/version)
    base: Path

    def conf(self, extra: str, unprivileged: bool = False) -> None:
        text = P.default_ct_conf(self.ct.name) + ("unprivileged: 1\n" if unprivileged else "")
        P.write_ct_conf(self.sshd, self.ct.ctid, text + extra)

    def node(self, version: str | None, uvm: int | None = UVM) -> None:
        own = Path("/proc/devices").read_text().split("\nBlock devices:")
        lines = "195 nvidia-frontend\n" + (f"{uvm} nvidia-uvm\n" if uvm else "")
        text = own[0].rstrip("\n") + "\n" + lines + "\nBlock devices:" + own[1]
        with (self.proc / "devices").open("r+") as fh:  # in place: the bind mount keeps the inode
            fh.truncate(0)
            fh.write(text)
        nv = self.proc / "nvidia"
        for child in nv.iterdir():
            child.unlink()
        if version is not None:
            (nv / "version").write_text((FIX / version).read_text())

    def _ns(self, script: str, stdin: str | None = None) -> None:
        pid = subprocess.run(
            ["lxc-info", "-n", self.ct.name, "-pH"], capture_output=True, text=True, check=True
        ).stdout.strip()
        done = subprocess.run(
            ["nsenter", "-t", pid, "-m", "--", "sh", "-c", script],
            input=stdin,
            text=True,
            capture_output=True,
        )
        assert done.returncode == 0, (script, done.stderr)

    def devices(self, nodes: tuple[tuple[str, int, int], ...]) -> None:
        made = " && ".join(f"mknod {p} c {a} {b}" for p, a, b in nodes) or "true"
        self._ns(
            f"rm -f /dev/nvidia0 /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools && {made}"
        )

    def smi(self, capture: str | None, rc: int = 0) -> None:
        if capture is None:
            self._ns("rm -f /usr/local/bin/nvidia-smi")
            return
        self._ns("cat > /usr/local/bin/.smi-out", (FIX / capture).read_text())
        self._ns(f"echo {rc} > /usr/local/bin/.smi-rc")
        self._ns("cat > /usr/local/bin/nvidia-smi && chmod 755 /usr/local/bin/nvidia-smi", FAKE_SMI)

    def healthy(self) -> None:
        self.node("node-version-580.95.05.txt")
        self.conf(RULES + MOUNTS)
        self.devices(NODES)
        self.smi("smi-580.95.05-rtxpro6000.txt")


@pytest.fixture(scope="module")
def gpu_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GpuNode]:
    missing = P.have("/usr/sbin/sshd", "ssh-keygen", "lxc-create", "nsenter", "unshare")
    require_part(missing is None, missing or "")
    require_part(os.geteuid() == 0, "LXC containers, mknod and mount namespaces need root")
    base = tmp_path_factory.mktemp("gpu-node")
    proc = base / "node-proc"
    (proc / "nvidia").mkdir(parents=True)
    (proc / "devices").write_text("")
    rules = (
        "lxc.cgroup2.devices.allow = c 195:* rwm",
        f"lxc.cgroup2.devices.allow = c {UVM}:* rwm",
    )
    stack = contextlib.ExitStack()
    with stack:
        ct = stack.enter_context(
            P.lxc_container(
                base / "ws", name=f"{P.NAME_PREFIX}{os.getpid()}-gpu", extra_config=rules
            )
        )
        sd = stack.enter_context(P.sshd(base / "sshd", node_proc=proc))
        sd.map_file.write_text(f"{ct.ctid} {ct.name}\n")
        node = GpuNode(sd, ct, proc, base)
        node._ns("mount -t tmpfs -o size=4m tmpfs /usr/local/bin")  # this container's only
        yield node


def _inventory(node: GpuNode, tmp: Path, devices: str) -> list[str]:
    cfg = tmp / "run.toml"
    tiny = (REPO / "configs" / "tiny-cpu.toml").read_text()
    cfg.write_text(
        tiny.replace('target_devices = ["cpu"]', f"target_devices = {devices}").replace(
            'drafter_devices = ["cpu"]', f"drafter_devices = {devices}"
        )
    )
    parts = P.Parts(node.sshd, node.ct)
    return P.pinned_inventory(parts, tmp, run_config=cfg)


def _doctor(
    inv: list[str], capsys: pytest.CaptureFixture[str], *flags: str
) -> tuple[int, dict[str, Any]]:
    capsys.readouterr()
    code = cli_main([*inv, "doctor", "ct", "--json", *flags])
    return code, json.loads(capsys.readouterr().out)


def _failing(report: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in report["checks"] if c["status"] == "fail"}


def test_healthy_passthrough_passes_and_a_cpu_torch_is_named(
    gpu_node: GpuNode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.healthy()
    inv = _inventory(gpu_node, tmp_path, '["cuda:0"]')
    code, rep = _doctor(inv, capsys, "--quick")
    by = {c["name"]: c for c in rep["checks"]}
    assert [c["name"] for c in rep["checks"]] == [
        "container", "gpu-nodes", "cgroup", "driver", "torch", "shm", "memory"
    ]  # fmt: skip
    for name in ("container", "gpu-nodes", "cgroup", "driver", "shm", "memory"):
        assert by[name]["status"] == "ok", by[name]
    assert by["driver"]["detail"] == "580.95.05 on the node and in the container"
    assert by["cgroup"]["detail"] == f"device access allowed (c 195:*, c {UVM}:*)"
    assert code == 1 and set(_failing(rep)) == {"torch"}
    assert "CPU build, but the run config names 1 GPU(s)" in by["torch"]["detail"]
    assert by["torch"]["fix"] == [
        "dflashctl setup ct (installs the CUDA build that matches the driver)"
    ]


KEEP = "keep"  # Case.version: the healthy node's module


@dataclass(frozen=True)
class Case:
    check: str
    detail: str
    fix: str
    conf: str | None = None
    unprivileged: bool = False
    drop: str | None = None  # a device node the container lacks
    stale: int | None = None  # the major the container's uvm nodes were made with
    version: str | None = KEEP  # the node's /proc/driver/nvidia/version capture (None: no module)
    smi: tuple[str, int] | str | None = KEEP  # (capture, exit status); None: no nvidia-smi


NO_UVM_MOUNT = RULES + MOUNTS.replace("/dev/nvidia-uvm dev/nvidia-uvm none", "X")
UVM_LINE = "lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file"


def _install(v: str) -> str:
    return (
        f"install NVIDIA userland {v} in the container without its kernel module: sh "
        f"NVIDIA-Linux-x86_64-{v}.run --no-kernel-module (or the distribution's "
        f"nvidia-utils/libnvidia-compute {v})"
    )


CASES = {
    "no uvm node": Case(
        "gpu-nodes", "missing in the container: /dev/nvidia-uvm", UVM_LINE,
        conf=NO_UVM_MOUNT, drop="/dev/nvidia-uvm",
    ),
    "no cgroup rule for uvm": Case(
        "cgroup",
        f"no lxc.cgroup2.devices.allow rule for major {UVM} (/dev/nvidia-uvm, "
        "/dev/nvidia-uvm-tools)",
        f"lxc.cgroup2.devices.allow: c {UVM}:* rwm",
        conf=f"lxc.cgroup2.devices.allow: c 195:* rwm\n{MOUNTS}",
    ),
    "stale uvm major": Case(
        "gpu-nodes",
        f"/dev/nvidia-uvm has major 511, the node's is {UVM}; "
        f"/dev/nvidia-uvm-tools has major 511, the node's is {UVM}",
        UVM_LINE,
        stale=511,
    ),
    "node/container version mismatch": Case(
        "driver",
        "node kernel module 580.95.05, container userland 550.90; nvidia-smi: Failed to "
        "initialize NVML: Driver/library version mismatch",
        _install("580.95.05"),
        smi=("smi-mismatch-nvml-550.90.txt", 18),
    ),
    "an older node driver": Case(
        "driver",
        "node kernel module 550.54.15, container userland 570.172.08",
        _install("550.54.15"),
        version="node-version-550.54.15.txt",
        smi=("smi-570.172.08-rtxpro6000.txt", 0),
    ),
    "no nvidia-smi in the container": Case(
        "driver",
        "no nvidia-smi in the container (the node's module is 580.95.05)",
        _install("580.95.05"),
        smi=None,
    ),
    "no kernel module on the node": Case(
        "driver",
        "the node has no NVIDIA kernel module loaded (no /proc/driver/nvidia/version)",
        "on the node: install the NVIDIA driver, then modprobe nvidia && nvidia-modprobe -c 0 -u",
        version=None,
    ),
    "unprivileged without the uvm node": Case(
        "gpu-nodes", "missing in the container: /dev/nvidia-uvm", "dev0: /dev/nvidia-uvm",
        conf=NO_UVM_MOUNT, unprivileged=True, drop="/dev/nvidia-uvm",
    ),
}  # fmt: skip


def _apply(node: GpuNode, case: Case) -> None:
    node.healthy()
    if case.version != KEEP:
        node.node(case.version)
    if case.conf is not None:
        node.conf(case.conf, unprivileged=case.unprivileged)
    if case.drop is not None:
        node.devices(tuple(n for n in NODES if n[0] != case.drop))
    if case.stale is not None:
        major = case.stale
        node.devices(tuple((p, major if "uvm" in p else a, b) for p, a, b in NODES))
    if case.smi != KEEP:
        if case.smi is None:
            node.smi(None)
        elif isinstance(case.smi, tuple):
            node.smi(*case.smi)


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_broken_case_yields_its_check_and_fix(
    name: str, gpu_node: GpuNode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    case = CASES[name]
    _apply(gpu_node, case)
    inv = _inventory(gpu_node, tmp_path, '["cuda:0"]')
    code, rep = _doctor(inv, capsys, "--quick")
    failing = _failing(rep)
    assert code == 1
    assert set(failing) == {case.check, "torch"}, failing  # torch: this container's is CPU
    assert failing[case.check]["detail"] == case.detail
    assert case.fix in failing[case.check]["fix"]
    # the text form: one line per check, the fix lines under the failure
    capsys.readouterr()
    assert cli_main([*inv, "doctor", "ct", "--quick"]) == 1
    text = capsys.readouterr().out.splitlines()
    row = next(i for i, ln in enumerate(text) if ln.split()[1:3] == [case.check, "fail"])
    assert text[row].endswith(case.detail)
    fixes = [ln.split("fix:", 1)[1].strip() for ln in text[row + 1 :] if "fix:" in ln]
    assert case.fix in fixes
    assert text[-1].startswith("doctor: FAILED: ") and f"ct {case.check}" in text[-1]


def test_cpu_config_passes_every_check(
    gpu_node: GpuNode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No GPU in the run config: nothing to pass through, and the full doctor (no release
    deployed: the disk check says so, the self-test is skipped) exits 0."""
    gpu_node.healthy()
    inv = _inventory(gpu_node, tmp_path, '["cpu"]')
    code, rep = _doctor(inv, capsys)
    assert code == 0 and rep["ok"] is True, rep
    by = {c["name"]: c for c in rep["checks"]}
    assert by["gpu-nodes"]["detail"] == "the run config names no GPU: no device nodes needed"
    assert (
        by["torch"]["status"] == "ok"
        and "CPU build; the run config names no GPU" in (by["torch"]["detail"])
    )
    assert by["disk"]["status"] == "warn" and "no release deployed" in by["disk"]["detail"]
    assert by["self-test"]["status"] == "skipped"


def test_deploy_refuses_with_the_failing_checks_line_and_caches_a_pass(
    gpu_node: GpuNode, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    gpu_node.healthy()
    gpu_node.devices(tuple(n for n in NODES if n[0] != "/dev/nvidia-uvm"))
    inv = _inventory(gpu_node, tmp_path, '["cuda:0"]')
    tree = P.frozen_tree(tmp_path / "tree")
    capsys.readouterr()
    assert cli_main([*inv, "deploy", "ct", "--tree", str(tree), "--no-memory-check"]) == 1
    err = capsys.readouterr().err
    assert "ct: doctor gpu-nodes: /dev/nvidia-uvm has" not in err
    assert "ct: doctor gpu-nodes: missing in the container: /dev/nvidia-uvm" in err
    assert (
        "fix: lxc.mount.entry: /dev/nvidia-uvm dev/nvidia-uvm none bind,optional,create=file" in err
    )
    assert "ct: doctor torch: " in err
    assert not (gpu_node.ct.workdir_host / "current").exists()  # refused before anything landed
    # a CPU run (a CPU container: no nvidia-smi, which deploy's own preflight would ask torch
    # about): the checks pass once, are stamped, and the next deploy of the release skips them
    gpu_node.smi(None)
    (tmp_path / "cpu").mkdir()
    cpu = _inventory(gpu_node, tmp_path / "cpu", '["cpu"]')
    assert cli_main([*cpu, "deploy", "ct", "--tree", str(tree), "--no-memory-check"]) == 0
    first = capsys.readouterr().out
    assert (
        "ct: doctor: quick checks passed (container, gpu-nodes, cgroup, driver, torch, shm, memory)"
        in first
    )
    stamps = list((gpu_node.ct.workdir_host / "doctor").glob("*.ok"))
    assert len(stamps) == 1 and stamps[0].read_text() == "driver 580.95.05\n"
    assert cli_main([*cpu, "deploy", "ct", "--tree", str(tree), "--no-memory-check"]) == 0
    assert "doctor" not in capsys.readouterr().out
    # the node's driver changed: the stamp no longer holds, the checks run again
    gpu_node.node("node-version-550.54.15.txt")
    assert cli_main([*cpu, "deploy", "ct", "--tree", str(tree), "--no-memory-check"]) == 0
    assert "ct: doctor: quick checks passed" in capsys.readouterr().out
