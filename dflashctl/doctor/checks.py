"""`dflashctl doctor`'s rules (pure): facts in, one `Check` per concern out, each failure with
the exact fix (the line for /etc/pve/lxc/CTID.conf, the driver to install, the key to change).

The GPU passthrough rules follow Proxmox's two ways of giving a container a device: raw
`lxc.mount.entry` binds plus `lxc.cgroup2.devices.allow` rules for the majors (nvidia: 195,
nvidia-uvm: dynamic, read from the node's /proc/devices), or since PVE 8.1 `devN:` entries,
which need no cgroup lines and work unprivileged. The container's NVIDIA userland must be the
node's kernel module version exactly ("Driver/library version mismatch" otherwise).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from dflashctl.doctor.facts import NVIDIA_MAJOR, ContainerFacts, CtConfig, NodeFacts
from dflashctl.doctor.needs import Needs

Status = Literal["ok", "warn", "fail", "skipped"]
GIB = 1024**3
MIB = 1024**2


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: tuple[str, ...] = field(default=())


def device_paths(needs: Needs) -> list[str]:
    """The nodes a run on `needs`' GPUs opens: one per GPU, ctl, uvm and uvm-tools."""
    if not needs.gpus:
        return []
    gpus = [f"/dev/nvidia{i}" for i in range(needs.gpus)]
    return [*gpus, "/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]


def expected_major(path: str, majors: dict[str, int]) -> int | None:
    if path.startswith("/dev/nvidia-uvm"):
        return majors.get("nvidia-uvm")
    return majors.get("nvidia-frontend", majors.get("nvidia", NVIDIA_MAJOR))


def mount_line(path: str, unprivileged: bool, index: int) -> str:
    """The config line that brings `path` into the container."""
    if unprivileged:
        return f"dev{index}: {path}"
    return f"lxc.mount.entry: {path} {path.lstrip('/')} none bind,optional,create=file"


def check_container(state: str, ctid: int, cfg: CtConfig | None, error: str | None) -> Check:
    if state != "running":
        return Check(
            "container", "fail", f"CT {ctid} is {state}", (f"pct start {ctid} (on the node)",)
        )
    if cfg is None:
        return Check("container", "fail", f"pct config {ctid}: {error}")
    if cfg.unprivileged:
        how = (
            "unprivileged: GPU nodes come from devN entries (PVE >= 8.1) with their gid, "
            "mknod inside cannot work"
        )
    else:
        how = (
            "privileged: GPU nodes come from lxc.mount.entry binds (or devN entries), "
            "allowed by lxc.cgroup2.devices.allow rules"
        )
    return Check("container", "ok", f"CT {ctid} running, {how}")


def check_nodes(needs: Needs, node: NodeFacts, ct: ContainerFacts, ctid: int) -> Check:
    paths = device_paths(needs)
    if not paths:
        return Check("gpu-nodes", "ok", "the run config names no GPU: no device nodes needed")
    cfg = node.config
    unpriv = bool(cfg and cfg.unprivileged)
    missing = [p for p in paths if p not in ct.nodes]
    wrong = []
    for p in paths:
        have = ct.nodes.get(p)
        want = expected_major(p, node.majors)
        if have is not None and (not have.char or (want is not None and have.major != want)):
            wrong.append((p, have.major, want))
    if not missing and not wrong:
        return Check("gpu-nodes", "ok", f"{len(paths)} device nodes: {', '.join(paths)}")
    fix: list[str] = []
    parts = []
    if missing:
        parts.append(f"missing in the container: {', '.join(missing)}")
        first = len(cfg.dev_entries) if cfg else 0
        fix += [mount_line(p, unpriv, first + i) for i, p in enumerate(missing)]
    for p, have_major, want in wrong:
        parts.append(f"{p} has major {have_major}, the node's is {want}")
        fix.append(f"rm {p} in the container (a stale node made by hand); bind it from the node:")
        fix.append(mount_line(p, unpriv, len(cfg.dev_entries) if cfg else 0))
    fix.append(f"add to /etc/pve/lxc/{ctid}.conf on the node, then: pct reboot {ctid}")
    return Check("gpu-nodes", "fail", "; ".join(parts), tuple(fix))


def check_cgroup(needs: Needs, node: NodeFacts, ct: ContainerFacts, ctid: int) -> Check:
    paths = device_paths(needs)
    cfg = node.config
    if not paths or cfg is None:
        return Check("cgroup", "ok", "no GPU device nodes to allow")
    majors: dict[int, list[str]] = {}
    for p in paths:
        if cfg.provides(p) == "devN":
            continue  # PVE sets the device rules for devN entries itself
        major = expected_major(p, node.majors)
        if major is not None:
            majors.setdefault(major, []).append(p)
    lacking = sorted(m for m in majors if not cfg.allows(m))
    # a node with the wrong major is gpu-nodes' finding, even when the cgroup refuses it
    denied = [
        p
        for p, err in ct.opens.items()
        if "not permitted" in err.lower()
        and p in ct.nodes
        and ct.nodes[p].major == expected_major(p, node.majors)
    ]
    if not lacking and not denied:
        rules = ", ".join(f"c {m}:*" for m in sorted(majors)) or "devN entries"
        return Check("cgroup", "ok", f"device access allowed ({rules})")
    fix = [f"lxc.cgroup2.devices.allow: c {m}:* rwm" for m in lacking]
    parts = []
    if lacking:
        names = "; ".join(f"major {m} ({', '.join(majors[m])})" for m in lacking)
        parts.append(f"no lxc.cgroup2.devices.allow rule for {names}")
    if denied:
        parts.append(f"opening {', '.join(denied)} in the container: Operation not permitted")
    fix.append(f"add to /etc/pve/lxc/{ctid}.conf on the node, then: pct reboot {ctid}")
    return Check("cgroup", "fail", "; ".join(parts), tuple(fix))


def _install_line(version: str) -> str:
    return (
        f"install NVIDIA userland {version} in the container without its kernel module: "
        f"sh NVIDIA-Linux-x86_64-{version}.run --no-kernel-module (or the distribution's "
        f"nvidia-utils/libnvidia-compute {version})"
    )


def check_driver(needs: Needs, node: NodeFacts, ct: ContainerFacts) -> Check:
    if not needs.gpus:
        return Check("driver", "ok", "the run config names no GPU: no driver needed")
    if node.driver is None:
        return Check(
            "driver",
            "fail",
            "the node has no NVIDIA kernel module loaded (no /proc/driver/nvidia/version)",
            (
                "on the node: install the NVIDIA driver, then modprobe nvidia && nvidia-modprobe "
                "-c 0 -u",
            ),
        )
    want = node.driver
    smi = ct.smi
    if not smi.present:
        return Check(
            "driver",
            "fail",
            f"no nvidia-smi in the container (the node's module is {want})",
            (_install_line(want),),
        )
    userland = smi.library or smi.driver or (ct.nvml[0] if ct.nvml else None)
    others = sorted(v for v in ct.nvml if v != want)
    if smi.mismatch or userland != want or others:
        seen = userland or "unknown"
        why = f"; nvidia-smi: {smi.first_error()}" if smi.mismatch or smi.rc else ""
        extra = f"; libnvidia-ml {', '.join(others)} present" if others else ""
        return Check(
            "driver",
            "fail",
            f"node kernel module {want}, container userland {seen}{why}{extra}",
            (_install_line(want),),
        )
    return Check("driver", "ok", f"{want} on the node and in the container")


def check_torch(needs: Needs, ct: ContainerFacts, host: str, python: str) -> Check:
    t = ct.torch
    setup = f"dflashctl setup {host}"
    if not t.present:
        return Check("torch", "fail", f"{python}: no torch ({t.error})", (setup,))
    build = f"torch {t.version}, " + (f"CUDA {t.cuda} build" if t.cuda else "CPU build")
    if not needs.gpus:
        return Check("torch", "ok", f"{build}; the run config names no GPU")
    if not t.cuda:
        return Check(
            "torch",
            "fail",
            f"{build}, but the run config names {needs.gpus} GPU(s)",
            (f"{setup} (installs the CUDA build that matches the driver)",),
        )
    smi_cuda = ct.smi.cuda
    if smi_cuda is not None:
        major = int(t.cuda.split(".")[0])
        if smi_cuda[0] < major:
            return Check(
                "torch",
                "fail",
                f"{build}; the driver supports CUDA {smi_cuda[0]}.{smi_cuda[1]} only",
                (
                    "upgrade the node's driver (and the container's userland to match), or "
                    f"{setup} to install a torch built for CUDA {smi_cuda[0]}.x",
                ),
            )
    if not t.available:
        return Check(
            "torch",
            "fail",
            f"{build}, but torch.cuda.is_available() is false (see gpu-nodes, cgroup, driver)",
        )
    if t.count < needs.gpus:
        return Check(
            "torch",
            "fail",
            f"{build} sees {t.count} GPU(s); the run config names cuda:{needs.gpus - 1}",
            ("pass the missing GPUs through (gpu-nodes), or change topology.*_devices",),
        )
    caps = ", ".join(f"sm_{c.replace('.', '')}" for c in sorted(set(t.capabilities)))
    return Check("torch", "ok", f"{build}; {t.count} GPU(s), {caps}")


def check_limits(needs: Needs, ct: ContainerFacts, ctid: int) -> list[Check]:
    out: list[Check] = []
    shm = ct.shm_bytes
    if needs.shm_bytes and shm is not None and shm < needs.shm_bytes:
        out.append(
            Check(
                "shm",
                "warn",
                f"/dev/shm is {shm / MIB:,.0f} MiB; {needs.cuda_ranks} CUDA ranks' NCCL wants "
                f"{needs.shm_bytes / MIB:,.0f} MiB",
                ("enlarge /dev/shm in the container (a tmpfs mount of 1G or more)",),
            )
        )
    else:
        size = "unknown" if shm is None else f"{shm / MIB:,.0f} MiB"
        out.append(Check("shm", "ok", f"/dev/shm {size} (needs {needs.shm_bytes / MIB:,.0f} MiB)"))
    limit, need = ct.memory_limit, needs.host_bytes
    if limit is not None and limit < need:
        out.append(
            Check(
                "memory",
                "fail",
                f"the container may use {limit / GIB:.1f} GiB; the run's host buffers and "
                f"processes need ~{need / GIB:.1f} GiB",
                (f"pct set {ctid} --memory {-(-need // MIB)} (on the node)",),
            )
        )
    else:
        have = "unlimited" if limit is None else f"{limit / GIB:.1f} GiB"
        out.append(Check("memory", "ok", f"{have} (needs ~{need / GIB:.1f} GiB)"))
    return out
