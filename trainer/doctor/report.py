"""The doctor's results: one per (device, stage), as text lines or JSON, and the exit code."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Literal

from trainer.errors import ExitCode

Status = Literal["ok", "warn", "fail", "skipped"]
STAGES = ("alloc", "attention", "ce", "step", "copy", "nccl")
CUDA_STAGES = ("attention", "ce", "copy", "nccl")


@dataclass(frozen=True)
class StageResult:
    device: str  # "cuda:1", "cuda:2->cuda:0" for a copy, "-" for a stage over no device
    stage: str
    status: Status
    detail: str
    seconds: float = 0.0

    def line(self) -> str:
        took = f" ({self.seconds:.1f} s)" if self.status in ("ok", "warn", "fail") else ""
        return f"{self.device:<16} {self.stage:<10} {self.status:<8} {self.detail}{took}"


def failed(results: list[StageResult]) -> list[StageResult]:
    return [r for r in results if r.status == "fail"]


def summary(results: list[StageResult]) -> str:
    bad = failed(results)
    ran = sum(r.status != "skipped" for r in results)
    skipped = len(results) - ran
    if bad:
        names = ", ".join(f"{r.device} {r.stage}" for r in bad)
        return f"doctor: FAILED: {names} ({ran} stages ran, {skipped} skipped)"
    warned = [r for r in results if r.status == "warn"]
    note = f", {len(warned)} with a warning" if warned else ""
    return f"doctor: ok ({ran} stages ran{note}, {skipped} skipped)"


def exit_code(results: list[StageResult]) -> int:
    return int(ExitCode.FAILED if failed(results) else ExitCode.OK)


def to_json(config: str, results: list[StageResult]) -> str:
    return json.dumps(
        {
            "config": config,
            "ok": not failed(results),
            "failed": [f"{r.device} {r.stage}" for r in failed(results)],
            "stages": [asdict(r) for r in results],
        },
        indent=2,
    )
