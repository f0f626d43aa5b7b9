"""The scripts `dflashctl doctor` runs (pure builders, no I/O): one on the Proxmox node, one in
the container, each printing `@@ NAME` sections that `dflashctl.doctor.facts` parses.

Node: `pct config CTID`, `/proc/devices` (the nvidia and nvidia-uvm majors), the kernel
module's `/proc/driver/nvidia/version`, the GPUs it drives. Container: the NVIDIA device nodes
(type, major, minor) and whether each opens (the device cgroup answers EPERM), `nvidia-smi`
and the libnvidia-ml files, `/dev/shm`, the memory limit, free disk under the workdir, the
network interfaces and what the container's python says about torch. POSIX sh: an empty
container has no python yet.
"""

from __future__ import annotations

from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.pct import pct_config

NODE_SCRIPT = r"""
echo "@@ config"
"$@" 2>&1
rc=$?
echo "@@ devices"
cat /proc/devices 2>/dev/null
echo "@@ version"
cat /proc/driver/nvidia/version 2>/dev/null
echo "@@ gpus"
ls /proc/driver/nvidia/gpus 2>/dev/null
exit $rc
"""

TORCH_PROBE = r"""
import json
try:
    import torch
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}".splitlines()[0][:200]}))
    raise SystemExit(0)
out = {"version": torch.__version__, "cuda": torch.version.cuda, "available": False,
       "count": 0, "capabilities": []}
try:
    out["available"] = bool(torch.cuda.is_available())
    if out["available"]:
        out["count"] = torch.cuda.device_count()
        out["capabilities"] = ["%d.%d" % torch.cuda.get_device_capability(i)
                               for i in range(out["count"])]
except Exception as exc:
    out["cuda_error"] = str(exc).splitlines()[0][:200]
print(json.dumps(out))
"""

CONTAINER_SCRIPT = r"""
wd=$1 py=$2 torch_probe=$3 current=$4
echo "@@ devices"
for f in /dev/nvidia* /dev/nvidia-caps/*; do
  [ -e "$f" ] && stat -c '%n|%F|%t|%T' "$f"
done
echo "@@ open"
for f in /dev/nvidia[0-9]* /dev/nvidiactl /dev/nvidia-uvm /dev/nvidia-uvm-tools; do
  [ -c "$f" ] || continue
  if err=$( (exec 3<"$f") 2>&1 ); then echo "$f|ok"; else echo "$f|$err" | head -n 1; fi
done
echo "@@ smi"
if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi 2>&1; echo "rc=$?"; else echo absent; fi
echo "@@ nvml"
ls /usr/lib/x86_64-linux-gnu /usr/lib/aarch64-linux-gnu /usr/lib64 /usr/lib 2>/dev/null \
  | grep 'libnvidia-ml\.so\.'
echo "@@ shm"
df -Pk /dev/shm 2>/dev/null | awk 'NR == 2 { printf "%d\n", $2 * 1024 }'
echo "@@ memory"
if [ -r /sys/fs/cgroup/memory.max ]; then cat /sys/fs/cgroup/memory.max
elif [ -r /sys/fs/cgroup/memory/memory.limit_in_bytes ]; then
  cat /sys/fs/cgroup/memory/memory.limit_in_bytes
fi
echo "@@ disk"
d=$wd
while [ ! -d "$d" ]; do d=$(dirname "$d"); done
df -Pk "$d" | awk 'NR == 2 { printf "%d\n", $4 * 1024 }'
echo "@@ infiniband"
ls /dev/infiniband 2>/dev/null | tr '\n' ' '
echo
echo "@@ current"
readlink "$current" 2>/dev/null
echo "@@ ifaces"
ls /sys/class/net 2>/dev/null | tr '\n' ' '
echo
echo "@@ torch"
if command -v "$py" >/dev/null 2>&1; then
  "$py" -c "$torch_probe" 2>&1 | tail -n 3
else
  echo "{\"error\": \"$py: no such interpreter in the container\"}"
fi
"""


def node_probe_argv(ctid: int) -> list[str]:
    """The node-side facts (run outside the container); exits with `pct config`'s status."""
    return ["sh", "-c", NODE_SCRIPT, "doctor-node", *pct_config(ctid)]


def container_probe_argv(workdir: str, python: str) -> list[str]:
    current = RemoteLayout(workdir).current
    return ["sh", "-c", CONTAINER_SCRIPT, "doctor-ct", workdir, python, TORCH_PROBE, current]


def stamp_read_argv(workdir: str, release: str) -> list[str]:
    """Prints the stamp of passed quick checks for `release` (empty: none)."""
    return ["sh", "-c", 'cat "$1" 2>/dev/null; exit 0', "doctor-stamp", _stamp(workdir, release)]


def stamp_write_argv(workdir: str, release: str) -> list[str]:
    """Writes stdin as the stamp (mkdir -p; temp + rename)."""
    script = 'mkdir -p "$(dirname "$1")" && cat > "$1.tmp.$$" && mv -f "$1.tmp.$$" "$1"'
    return ["sh", "-c", script, "doctor-stamp", _stamp(workdir, release)]


def _stamp(workdir: str, release: str) -> str:
    return RemoteLayout(workdir).doctor_stamp(release)
