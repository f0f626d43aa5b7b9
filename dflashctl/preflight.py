"""Preflight: can this container run the trainer? One round trip, one line per failure.

The probe runs under the container's python and reports facts as JSON; judging them is a pure
function here, so the rules are unit-tested without a container.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

REQUIRED_MODULES = ("torch", "numpy", "pydantic")
GIB = 1024**3

# argv: WORKDIR RELEASE_ID MODE. Prints one JSON object. Never raises for a missing module.
# MODE "import" really imports the modules (catches broken CUDA/ABI installs; torch takes
# seconds); "metadata" only reads installed versions (fast; for repeated deploys in tests).
PROBE_SCRIPT = r"""
import importlib, importlib.metadata, json, os, shutil, subprocess, sys
workdir, release, mode = sys.argv[1], sys.argv[2], sys.argv[3]
out = {"python": sys.version.split()[0], "modules": {}, "errors": {}}
for name in ("numpy", "pydantic", "torch"):
    try:
        if mode == "import":
            mod = importlib.import_module(name)
            out["modules"][name] = getattr(mod, "__version__", "?")
        else:
            out["modules"][name] = importlib.metadata.version(name)
    except Exception as exc:
        out["errors"][name] = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
os.makedirs(workdir, exist_ok=True)
st = os.statvfs(workdir)
out["free_bytes"] = st.f_bavail * st.f_frsize
out["complete"] = os.path.isfile(os.path.join(workdir, "releases", release, ".complete"))
cur = os.path.join(workdir, "current")
out["current"] = os.path.basename(os.readlink(cur)) if os.path.islink(cur) else None
smi = shutil.which("nvidia-smi")
out["nvidia_smi"] = bool(smi)
out["gpus"] = []
if smi:
    try:
        res = subprocess.run([smi, "--query-gpu=index,name,memory.total",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        if res.returncode == 0:
            out["gpus"] = [l.strip() for l in res.stdout.splitlines() if l.strip()]
        else:
            out["smi_error"] = (res.stderr or res.stdout).strip().splitlines()[-1:] or ["failed"]
    except Exception as exc:
        out["smi_error"] = [str(exc)]
    if "torch" in out["modules"] and mode == "import":
        import torch
        out["cuda_available"] = bool(torch.cuda.is_available())
        out["torch_cuda"] = torch.version.cuda
print(json.dumps(out))
"""


@dataclass(frozen=True)
class Preflight:
    """Facts about the container and the verdict on them."""

    python: str | None
    modules: dict[str, str]
    free_bytes: int
    gpus: list[str]
    release_complete: bool
    current: str | None
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def summary(self) -> str:
        mods = " ".join(f"{k}={v}" for k, v in sorted(self.modules.items()))
        gpu = f"{len(self.gpus)} GPU(s)" if self.gpus else "no GPUs"
        return f"python {self.python} {mods}; {self.free_bytes / GIB:.1f} GiB free; {gpu}"


def judge_probe(
    host: str, python: str, workdir: str, probe: dict[str, Any], *, min_free_bytes: int
) -> Preflight:
    """Turn probe facts into failures, each an actionable line naming the host."""
    failures: list[str] = []
    notes: list[str] = []
    modules = {str(k): str(v) for k, v in probe.get("modules", {}).items()}
    for name, err in sorted(probe.get("errors", {}).items()):
        failures.append(
            f"{host}: {python} cannot import {name} ({err}); install it in the container"
        )
    free = int(probe.get("free_bytes", 0))
    if free < min_free_bytes:
        failures.append(
            f"{host}: only {free / GIB:.2f} GiB free under {workdir} "
            f"(need {min_free_bytes / GIB:.2f} GiB); free space or move workdir"
        )
    gpus = [str(g) for g in probe.get("gpus", [])]
    if probe.get("nvidia_smi"):
        if probe.get("smi_error"):
            failures.append(f"{host}: nvidia-smi failed: {probe['smi_error'][0]}; check the driver")
        elif not gpus:
            failures.append(
                f"{host}: nvidia-smi lists no GPUs; check the container's GPU passthrough"
            )
        elif probe.get("cuda_available") is False:
            failures.append(
                f"{host}: nvidia-smi sees {len(gpus)} GPU(s) but torch.cuda.is_available() is False "
                f"(torch CUDA build: {probe.get('torch_cuda')}); install a CUDA build of torch"
            )
    else:
        notes.append(f"{host}: no nvidia-smi in the container: the trainer will run on CPU")
    return Preflight(
        python=probe.get("python"),
        modules=modules,
        free_bytes=free,
        gpus=gpus,
        release_complete=bool(probe.get("complete")),
        current=probe.get("current"),
        failures=failures,
        notes=notes,
    )


def parse_probe_output(stdout: str) -> dict[str, Any] | None:
    """The last JSON object line of the probe's stdout (site hooks may print before it)."""
    for line in reversed(stdout.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            try:
                value = json.loads(line)
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, dict) else None
    return None
