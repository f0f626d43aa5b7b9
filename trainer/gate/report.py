"""The gate's record (torch-free): the stages that ran, the figures, and the failure."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

PASS_SHARE = 0.9  # tau must reach 0.9 x block size


class GateFailure(Exception):
    """The gate stopped at `stage`; `detail` says what differed."""

    def __init__(self, stage: str, detail: str) -> None:
        super().__init__(f"{stage}: {detail}")
        self.stage = stage
        self.detail = detail


@dataclass
class Report:
    """The stages that ran, in order, and what the run measured."""

    stages: list[dict[str, Any]] = field(default_factory=list)
    figures: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.perf_counter)

    @contextmanager
    def stage(self, name: str) -> Iterator[dict[str, Any]]:
        """Time one stage; it is ok when the block ends without raising. The block may put a
        `detail` into the entry it gets; one line is printed when it passes."""
        entry: dict[str, Any] = {"stage": name, "ok": False}
        self.stages.append(entry)
        t0 = time.perf_counter()
        try:
            yield entry
        finally:
            entry["seconds"] = round(time.perf_counter() - t0, 3)
        entry["ok"] = True
        print(f"gate {name}: ok ({entry.get('detail', '')}; {entry['seconds']:.1f} s)", flush=True)

    def payload(self, *, passed: bool, failure: str | None) -> dict[str, Any]:
        return {
            "passed": passed,
            "failure": failure,
            "seconds": round(time.perf_counter() - self.started, 3),
            "stages": self.stages,
            **self.figures,
        }

    def summary(self) -> str:
        f = self.figures
        parts = [f"own loop tau {f.get('own_tau', 0.0):.2f}"]
        if "served_tau" in f:
            parts.append(f"{f.get('engine')} tau {f['served_tau']:.2f}")
        parts.append(f"of block {f.get('block_size')} (needs >= {f.get('threshold')})")
        return ", ".join(parts)
