"""Preflight: can this container run the trainer? One round trip, one line per failure.

The probe (dflashctl.remote.probe) runs under the container's python and reports facts as
JSON; judging them is a pure function here, so the rules are unit-tested without a container.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

REQUIRED_MODULES = ("torch", "numpy", "pydantic")
GIB = 1024**3


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


# --- the memory checks: will the run fit the GPUs, will its checkpoints fit the disk ---------

MIB = 1024**2
MEMORY_KEY = "model.max_query_rows"


@dataclass(frozen=True)
class MemoryVerdict:
    failures: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)


def smallest_gpu(gpus: list[str]) -> tuple[str, int] | None:
    """(name, memory.total MiB) of the smallest GPU in `index, name, memory.total` CSV lines."""
    best: tuple[str, int] | None = None
    for line in gpus:
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 3 or not parts[-1].isdigit():
            continue
        mib = int(parts[-1])
        if best is None or mib < best[1]:
            best = (", ".join(parts[1:-1]), mib)
    return best


def _mib(n: float) -> str:
    return f"{n / MIB:,.0f} MiB"


def judge_fit(host: str, config: str, gpu: tuple[str, int], rep: dict[str, Any]) -> list[str]:
    """The fit verdict: [] when every device fits, else one line naming the key and the value."""
    if rep.get("fits"):
        return []
    name, mib = gpu
    d = rep.get("drafter", {})
    largest = d.get("largest_max_query_rows")
    configured = d.get("configured", {}).get("max_query_rows")
    where = f"{host}: {config} does not fit the container's {name} ({mib} MiB)"
    bad = [dev for dev in rep.get("devices", []) if not dev.get("fits")]
    if bad and all("drafter" not in dev.get("roles", []) for dev in bad):
        dev = bad[0]
        return [
            f"{where}: target device {dev.get('device')} needs {_mib(dev.get('peak', 0))}, "
            f"{MEMORY_KEY} does not change that; use more target devices or smaller batches"
        ]
    if largest is None:
        return [
            f"{where}: no {MEMORY_KEY} fits (fixed costs and staged packets alone exceed it; "
            f"lower topology.hidden_depth or the batch token budget)"
        ]
    return [f"{where}: {MEMORY_KEY} = {configured}; the largest that fits is {largest}"]


def judge_disk(
    host: str, run_dir: str, probe: dict[str, Any], rep: dict[str, Any]
) -> MemoryVerdict:
    """Free space where the checkpoints go (run/checkpoints, else the run dir: the probe's
    `free_at`) against (checkpoint.keep_last + 1) checkpoints; warn within 2x."""
    ck = rep.get("checkpoint")
    if not isinstance(ck, dict) or "bytes" not in ck:
        return MemoryVerdict(
            notes=[
                f"{host}: the release's estimate has no checkpoint size: "
                "checkpoint disk check skipped"
            ]
        )
    size, keep = int(ck["bytes"]), int(ck.get("keep_last", 1))
    needed = max(0, size * (keep + 1) - int(probe.get("existing_bytes", 0)))
    free = int(probe.get("free_bytes", 0))
    at = probe.get("free_at") if isinstance(probe.get("free_at"), str) else run_dir
    what = (
        f"{_mib(free)} free under {at}, checkpoints need {_mib(needed)} "
        f"(checkpoint.keep_last = {keep}, +1 being written, {_mib(size)} each"
        + (", less those already there" if probe.get("existing_bytes") else "")
        + ")"
    )
    every = ck.get("keep_every_steps")
    extra = f"; checkpoint.keep_every_steps = {every} keeps more on top" if every else ""
    if free < needed:
        return MemoryVerdict(
            failures=[f"{host}: {what}; free space or lower checkpoint.keep_last{extra}"]
        )
    if free < 2 * needed:
        return MemoryVerdict(notes=[f"{host}: warning: only {what}, less than twice that{extra}"])
    return MemoryVerdict(notes=[f"{host}: checkpoints fit: {what}{extra}"])


def judge_memory(
    host: str, config: str, run_dir: str, gpus: list[str], probe: dict[str, Any]
) -> MemoryVerdict:
    """Both memory checks from the memory probe's output (MEMORY_SCRIPT)."""
    if probe.get("absent"):
        return MemoryVerdict(
            notes=[f"{host}: the release has no trainer.memory: fit and disk checks skipped"]
        )
    rc, rep = probe.get("rc"), probe.get("report")
    if rc not in (0, 1) or not isinstance(rep, dict):
        err = str(probe.get("error") or f"exit status {rc}")
        if probe.get("tmp"):
            err = err.replace(str(probe["tmp"]), config)
        return MemoryVerdict(
            notes=[
                f"{host}: memory estimate failed (exit {rc}): {err}; fit and checkpoint disk "
                f"checks not made"
            ]
        )
    failures: list[str] = []
    notes: list[str] = []
    gpu = smallest_gpu(gpus)
    if gpu is None:
        notes.append(
            f"{host}: nvidia-smi gave no memory.total ({gpus[0]!r}): memory fit check skipped"
            if gpus
            else f"{host}: no GPU in the container: memory fit check skipped"
        )
    else:
        fit = judge_fit(host, config, gpu, rep)
        failures += fit
        if not fit:
            d = rep.get("drafter", {})
            peak = max((dev.get("peak", 0) for dev in rep.get("devices", [])), default=0)
            notes.append(
                f"{host}: fits the container's {gpu[0]} ({gpu[1]} MiB): peak {_mib(peak)}; "
                f"largest {MEMORY_KEY} that fits: {d.get('largest_max_query_rows')}"
            )
    disk = judge_disk(host, run_dir, probe, rep)
    return MemoryVerdict(failures + disk.failures, notes + disk.notes)
