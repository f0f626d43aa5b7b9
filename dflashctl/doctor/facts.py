"""What `dflashctl doctor` reads, parsed (pure): the node's `pct config`, `/proc/devices` and
`/proc/driver/nvidia/version`, and the container's device nodes, NVIDIA userland, limits and
torch. The probes (`dflashctl.remote.doctor_probe`) print `@@ NAME` sections; nothing here
does I/O, so every rule is tested on captured text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

NVIDIA_MAJOR = 195  # nvidia-frontend: /dev/nvidia0.., /dev/nvidiactl (minor 255)


def sections(text: str) -> dict[str, str]:
    """`@@ name` lines split a probe's output into named sections."""
    out: dict[str, str] = {}
    name: str | None = None
    lines: list[str] = []
    for line in text.splitlines():
        if line.startswith("@@ "):
            if name is not None:
                out[name] = "\n".join(lines)
            name, lines = line[3:].strip(), []
        elif name is not None:
            lines.append(line)
    if name is not None:
        out[name] = "\n".join(lines)
    return out


@dataclass(frozen=True)
class CtConfig:
    """`pct config CTID`: the keys doctor judges."""

    unprivileged: bool
    memory_mib: int | None
    allow: tuple[str, ...]  # lxc.cgroup2.devices.allow values ("c 195:* rwm")
    mounts: tuple[str, ...]  # lxc.mount.entry values
    dev_entries: tuple[str, ...]  # devN: paths (PVE >= 8.1)

    def allows(self, major: int) -> bool:
        """A cgroup rule that lets the container open character devices of `major`."""
        for rule in self.allow:
            parts = rule.split()
            if parts and parts[0] == "a":
                return True
            if len(parts) >= 2 and parts[0] in ("c", "a"):
                maj = parts[1].split(":")[0]
                if maj in ("*", str(major)):
                    return True
        return False

    def provides(self, path: str) -> str | None:
        """How the config brings `path` into the container: "devN", "mount" or None."""
        if path in self.dev_entries:
            return "devN"
        rel = path.lstrip("/")
        for entry in self.mounts:
            parts = entry.split()
            if len(parts) >= 2 and (parts[0] == path or parts[1] == rel):
                return "mount"
            if len(parts) >= 2 and rel.startswith(parts[1].rstrip("/") + "/") and "dir" in entry:
                return "mount"
        return None


def parse_pct_config(text: str) -> CtConfig:
    allow: list[str] = []
    mounts: list[str] = []
    devs: list[str] = []
    unpriv = False
    memory: int | None = None
    for line in text.splitlines():
        if line.startswith("[") and line.rstrip().endswith("]"):
            break  # a snapshot section: not the live config
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key, value = key.strip(), value.strip()
        if key in ("lxc.cgroup2.devices.allow", "lxc.cgroup.devices.allow"):
            allow.append(value)
        elif key == "lxc.mount.entry":
            mounts.append(value)
        elif re.fullmatch(r"dev\d+", key):
            devs.append(value.split(",")[0])
        elif key == "unprivileged":
            unpriv = value == "1"
        elif key == "memory" and value.isdigit():
            memory = int(value)
    return CtConfig(unpriv, memory, tuple(allow), tuple(mounts), tuple(devs))


def parse_proc_devices(text: str) -> dict[str, int]:
    """`/proc/devices`' character devices: name -> major."""
    out: dict[str, int] = {}
    in_char = False
    for line in text.splitlines():
        if line.startswith("Character devices"):
            in_char = True
            continue
        if line.startswith("Block devices"):
            break
        parts = line.split()
        if in_char and len(parts) == 2 and parts[0].isdigit():
            out.setdefault(parts[1], int(parts[0]))
    return out


DRIVER_RE = re.compile(r"Kernel Module(?: for \S+)?\s+(\d+\.\d+(?:\.\d+)?)")


def kernel_module_version(text: str) -> str | None:
    """`NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.95.05  Release Build ...`."""
    m = DRIVER_RE.search(text)
    return m.group(1) if m else None


@dataclass(frozen=True)
class DeviceNode:
    path: str
    char: bool
    major: int
    minor: int


def parse_device_nodes(text: str) -> dict[str, DeviceNode]:
    """`stat -c '%n|%F|%t|%T'` lines (major and minor in hex)."""
    out: dict[str, DeviceNode] = {}
    for line in text.splitlines():
        parts = line.strip().split("|")
        if len(parts) != 4:
            continue
        path, kind, major, minor = parts
        try:
            node = DeviceNode(path, "character" in kind, int(major, 16), int(minor, 16))
        except ValueError:
            continue
        out[path] = node
    return out


def parse_open_errors(text: str) -> dict[str, str]:
    """`PATH|ok` or `PATH|the shell's error` per node the probe tried to open."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        path, sep, result = line.partition("|")
        if sep:
            out[path.strip()] = result.strip()
    return out


@dataclass(frozen=True)
class Smi:
    """The container's `nvidia-smi`: absent, or its output and exit status."""

    present: bool
    rc: int = 0
    text: str = ""

    @property
    def driver(self) -> str | None:
        m = re.search(r"(?:Driver|KMD) Version:\s*(\d+\.\d+(?:\.\d+)?)", self.text)
        return m.group(1) if m else None

    @property
    def library(self) -> str | None:
        """NVML's own version when it refuses the kernel module (a version mismatch)."""
        m = re.search(r"NVML library version:\s*(\d+\.\d+(?:\.\d+)?)", self.text)
        return m.group(1) if m else None

    @property
    def cuda(self) -> tuple[int, int] | None:
        m = re.search(r"CUDA (?:UMD )?Version:\s*(\d+)\.(\d+)", self.text)
        return (int(m.group(1)), int(m.group(2))) if m else None

    @property
    def mismatch(self) -> bool:
        return "version mismatch" in self.text

    def first_error(self) -> str:
        lines = [ln.strip() for ln in self.text.splitlines() if ln.strip()]
        return lines[0] if lines else f"exit status {self.rc}"


def parse_smi(text: str) -> Smi:
    lines = text.splitlines()
    if lines and lines[0].strip() == "absent":
        return Smi(False)
    rc = 0
    if lines and lines[-1].startswith("rc="):
        rc = int(lines[-1][3:] or 0)
        lines = lines[:-1]
    return Smi(True, rc, "\n".join(lines))


def nvml_versions(text: str) -> tuple[str, ...]:
    """Versions of the libnvidia-ml.so.X.Y.Z files in the container."""
    found = re.findall(r"libnvidia-ml\.so\.(\d+\.\d+(?:\.\d+)?)\b", text)
    return tuple(sorted(set(found)))


def parse_int(text: str) -> int | None:
    value = text.strip().splitlines()[0].strip() if text.strip() else ""
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class TorchFacts:
    present: bool
    version: str | None = None
    cuda: str | None = None  # torch.version.cuda (None: a CPU build)
    available: bool = False
    count: int = 0
    capabilities: tuple[str, ...] = ()
    error: str | None = None


def parse_torch(text: str) -> TorchFacts:
    """The last JSON line the torch probe printed, or why there is none."""
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                raw = json.loads(line)
            except ValueError:
                break
            if "error" in raw:
                return TorchFacts(False, error=str(raw["error"]))
            return TorchFacts(
                True,
                str(raw.get("version")),
                raw.get("cuda"),
                bool(raw.get("available")),
                int(raw.get("count", 0)),
                tuple(str(c) for c in raw.get("capabilities", [])),
            )
    last = text.strip().splitlines()[-1] if text.strip() else "no output"
    return TorchFacts(False, error=last)


@dataclass(frozen=True)
class NodeFacts:
    config: CtConfig | None
    config_error: str | None
    majors: dict[str, int]
    driver: str | None
    gpus: int  # /proc/driver/nvidia/gpus entries


@dataclass(frozen=True)
class ContainerFacts:
    nodes: dict[str, DeviceNode]
    opens: dict[str, str]
    smi: Smi
    nvml: tuple[str, ...]
    shm_bytes: int | None
    memory_limit: int | None  # None: unlimited
    free_bytes: int | None
    torch: TorchFacts
    ifaces: tuple[str, ...] = field(default=())
    infiniband: tuple[str, ...] = field(default=())
    current: str | None = None  # the release `current` points at


def parse_node(text: str, rc: int) -> NodeFacts:
    s = sections(text)
    cfg_text = s.get("config", "")
    error = (
        None if rc == 0 and "config" in s else (cfg_text.strip().splitlines() or ["no output"])[-1]
    )
    return NodeFacts(
        config=parse_pct_config(cfg_text) if error is None else None,
        config_error=error,
        majors=parse_proc_devices(s.get("devices", "")),
        driver=kernel_module_version(s.get("version", "")),
        gpus=len([ln for ln in s.get("gpus", "").splitlines() if ln.strip()]),
    )


def parse_container(text: str) -> ContainerFacts:
    s = sections(text)
    mem = s.get("memory", "").strip()
    limit = None if mem in ("", "max") else parse_int(mem)
    current = s.get("current", "").strip()
    return ContainerFacts(
        nodes=parse_device_nodes(s.get("devices", "")),
        opens=parse_open_errors(s.get("open", "")),
        smi=parse_smi(s.get("smi", "absent")),
        nvml=nvml_versions(s.get("nvml", "")),
        shm_bytes=parse_int(s.get("shm", "")),
        memory_limit=limit if limit is not None and limit < 2**60 else None,
        free_bytes=parse_int(s.get("disk", "")),
        torch=parse_torch(s.get("torch", "")),
        ifaces=tuple(s.get("ifaces", "").split()),
        infiniband=tuple(s.get("infiniband", "").split()),
        current=current.rsplit("/", 1)[-1] if current else None,
    )
