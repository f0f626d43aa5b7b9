"""The doctor's parsers and rules on captured text (no container): every captured nvidia-smi
banner and kernel-module line gives its version, `pct config` stops at snapshot sections,
and the driver rule names stray libnvidia-ml versions."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.doctor.checks import check_driver
from dflashctl.doctor.facts import (
    ContainerFacts,
    NodeFacts,
    Smi,
    TorchFacts,
    kernel_module_version,
    nvml_versions,
    parse_container,
    parse_pct_config,
    parse_proc_devices,
    parse_smi,
)
from dflashctl.doctor.needs import Needs

FIX = Path(__file__).resolve().parent / "fixtures" / "doctor"


@pytest.mark.parametrize(
    ("capture", "driver", "cuda"),
    [
        ("smi-580.95.05-rtxpro6000.txt", "580.95.05", (13, 0)),
        ("smi-570.172.08-rtxpro6000.txt", "570.172.08", (12, 8)),
        ("smi-610.43.02-rtxpro6000-kmd.txt", "610.43.02", (13, 3)),
    ],
)
def test_every_captured_banner_gives_its_driver_and_cuda(
    capture: str, driver: str, cuda: tuple[int, int]
) -> None:
    smi = parse_smi((FIX / capture).read_text() + "rc=0")
    assert (smi.present, smi.rc, smi.driver, smi.cuda, smi.mismatch) == (
        True,
        0,
        driver,
        cuda,
        False,
    )


def test_a_version_mismatch_names_the_library() -> None:
    smi = parse_smi((FIX / "smi-mismatch-nvml-550.90.txt").read_text() + "rc=18")
    assert smi.mismatch and smi.library == "550.90" and smi.driver is None and smi.rc == 18
    assert smi.first_error() == "Failed to initialize NVML: Driver/library version mismatch"
    assert parse_smi("absent") == Smi(False)


@pytest.mark.parametrize(
    ("capture", "version"),
    [
        ("node-version-580.95.05.txt", "580.95.05"),
        ("node-version-550.54.15.txt", "550.54.15"),
        ("node-version-535.216.03.txt", "535.216.03"),  # the proprietary module's wording
    ],
)
def test_kernel_module_versions(capture: str, version: str) -> None:
    assert kernel_module_version((FIX / capture).read_text()) == version
    assert kernel_module_version("") is None


def test_pct_config_and_proc_devices() -> None:
    cfg = parse_pct_config(
        "arch: amd64\nunprivileged: 1\nmemory: 65536\n"
        "lxc.cgroup2.devices.allow: c 195:* rwm\n"
        "lxc.mount.entry: /dev/nvidia0 dev/nvidia0 none bind,optional,create=file\n"
        "dev0: /dev/nvidia-uvm,gid=44\n"
        "[snap1]\nlxc.cgroup2.devices.allow: c 508:* rwm\n"
    )
    assert cfg.unprivileged and cfg.memory_mib == 65536
    assert cfg.allows(195) and not cfg.allows(508)  # the snapshot's rule is not live
    assert cfg.provides("/dev/nvidia0") == "mount" and cfg.provides("/dev/nvidia-uvm") == "devN"
    assert cfg.provides("/dev/nvidiactl") is None
    majors = parse_proc_devices(
        "Character devices:\n  1 mem\n195 nvidia-frontend\n508 nvidia-uvm\n\n"
        "Block devices:\n195 nvidia-uvm\n"
    )
    assert majors == {"mem": 1, "nvidia-frontend": 195, "nvidia-uvm": 508}


def test_stray_libnvidia_ml_versions_fail_the_driver_check() -> None:
    assert nvml_versions(
        "libnvidia-ml.so.1\nlibnvidia-ml.so.580.95.05\nlibnvidia-ml.so.550.90.07\n"
    ) == (
        "550.90.07",
        "580.95.05",
    )
    node = NodeFacts(None, None, {}, "580.95.05", 1)
    banner = (FIX / "smi-580.95.05-rtxpro6000.txt").read_text()
    ct = ContainerFacts(
        {},
        {},
        Smi(True, 0, banner),
        ("550.90.07", "580.95.05"),
        None,
        None,
        None,
        TorchFacts(False),
    )
    got = check_driver(Needs((0,), 1, 0, 0, 1), node, ct)
    assert got.status == "fail"
    assert (
        got.detail
        == "node kernel module 580.95.05, container userland 580.95.05; libnvidia-ml 550.90.07 present"
    )


def test_container_sections_and_unlimited_memory() -> None:
    ct = parse_container(
        "@@ devices\n/dev/nvidia0|character special file|c3|0\n@@ open\n/dev/nvidia0|ok\n"
        "@@ smi\nabsent\n@@ nvml\n@@ shm\n67108864\n@@ memory\n9223372036854771712\n"
        "@@ disk\n1024\n@@ infiniband\n\n@@ current\n/srv/x/releases/abc\n@@ ifaces\nlo eth0 \n"
        '@@ torch\n{"version": "2.13.0+cpu", "cuda": null, "available": false}\n'
    )
    assert ct.nodes["/dev/nvidia0"].major == 195 and ct.opens == {"/dev/nvidia0": "ok"}
    assert ct.memory_limit is None  # cgroup v1's "unlimited"
    assert (ct.shm_bytes, ct.free_bytes, ct.current, ct.ifaces) == (
        67108864,
        1024,
        "abc",
        ("lo", "eth0"),
    )
    assert ct.torch.present and ct.torch.cuda is None and ct.torch.version == "2.13.0+cpu"
