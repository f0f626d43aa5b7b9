"""Fixed data for the TUI tests: seed-shaped status lines and a replaying RunControl double.

The numbers follow the seed's first check (six buckets [0, 770, ..., 8192], q_pre filling to 50,
Ktok/s ramping to ~25, warmup of 3598 steps), generated through the trainer's own
`format_status_line` so the parser under test reads exactly what the trainer writes.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

from dflashctl.monitor.plan import RunShape, lr_schedule
from dflashctl.releases.deploy import DeployResult
from dflashctl.releases.preflight import Preflight
from dflashctl.runs.follow import FollowEvent, LogFollower
from dflashctl.runs.regen_view import RegenJob
from dflashctl.runs.service import RunService
from dflashctl.runs.snapshot import RunningMeasure, ServedEval
from trainer.events import (
    BUCKET_LOSS_KEY,
    TAU_KEY,
    EvalEvent,
    StatusEvent,
    format_bucket_losses,
    format_eval_line,
    format_status_line,
)
from trainer.events import run_state as contract

FIXED_NOW = 1_800_000_000.0
BOUNDARIES = (0, 770, 1216, 1728, 2432, 3296, 8192)
WARMUP = 3598
TOTAL = 89_950
PEAK_LR = 6e-4


warmup_cosine = lr_schedule(PEAK_LR, 0.1 * PEAK_LR)
"""The trainer's own schedule (linear warmup, cosine to 10% of peak)."""


def seed_shape(schedule: Any = warmup_cosine) -> RunShape:
    return RunShape(
        boundaries=BOUNDARIES,
        q_pre_capacity=50,
        q_hs_capacity=8,
        warmup_steps=WARMUP,
        total_steps=TOTAL,
        epochs=6.0,
        schedule=schedule,
    )


def status_line(
    i: int, *, starve: int | None = None, extras: Mapping[str, str] | None = None, **extra: str
) -> str:
    """The i-th status line of a run ramping up (deterministic, no RNG)."""
    ramp = min(1.0, i / 20)
    step = 30 * i
    q_pre = [max(0, min(50, 4 + 3 * i - b)) for b in range(6)]
    if starve is not None:
        q_pre[starve] = 0
    ev = StatusEvent(
        elapsed_min=i // 2,
        step=step,
        loss=None if i == 0 else 6.5 - 2.0 * ramp + 0.3 * math.sin(i),
        acc=None if i == 0 else 0.05 + 0.25 * ramp,
        streak=None if i == 0 else 0.1 + 1.5 * ramp,
        lr=None if i == 0 else warmup_cosine(step, WARMUP, TOTAL),
        noise=0.1,
        tgt_bps=0.4 * ramp * 2,
        dft_bps=0.3 * ramp * 2,
        ktok_s=25.1 * ramp + 0.4 * math.sin(i / 2) * ramp,
        q_pre=q_pre,
        q_hs=[i % 3],
        epoch=step / (TOTAL / 6),
        eta_s=None if i == 0 else 5.1 * 86400 / max(0.2, ramp),
        extra={**(extras or {}), **extra},
    )
    return format_status_line(ev)


def run_lines(n: int, **kw: Any) -> list[str]:
    return ["Starting pipeline...", "Pipeline running. Monitoring..."] + [
        status_line(i, **kw) for i in range(n)
    ]


BLOCK = 8
"""The drafter's block size in the eval fixtures: acc@1..acc@7."""


TAUS = (1.0, 1.42, 1.97, 2.61, 2.48, 2.55, 2.74, 2.69, 2.81, 2.77)
"""Simulated tau of the successive evaluations: climbing from the untrained 1.0, then jumpy."""


def eval_event(n: int) -> EvalEvent:
    """The n-th held-out evaluation (every 150 steps) of a drafter that is learning: tau climbs
    from 1.0 (`TAUS`), acc@k falls with k, `best` is the highest tau so far (ties: later)."""
    taus = [TAUS[i % len(TAUS)] for i in range(n + 1)]
    best = max(range(n + 1), key=lambda i: (taus[i], i))
    acc1 = min(0.95, 0.1 + 0.2 * n)
    acc_at = [round(acc1 * 0.8**k, 3) for k in range(BLOCK - 1)]
    return EvalEvent(
        step=150 * (n + 1),
        tau=taus[n],
        loss=round(6.0 - 0.4 * n, 4),
        acc=acc1,
        acc_at=acc_at,
        tau_exp=round(1.0 + sum(acc_at), 3),
        best=150 * (best + 1),
        extra={"rows": "256", "cost": "3.1%"},
    )


def bucket_losses(i: int) -> list[float | None]:
    """Mean loss per bucket in the i-th interval: each bucket learns alike but at its own scale
    (long sequences higher); the longest bucket has no batch in every third interval."""
    ramp = min(1.0, i / 20)
    out: list[float | None] = [round(5.6 - 2.0 * ramp + 0.22 * b, 4) for b in range(6)]
    if i % 3 == 2:
        out[5] = None
    return out


def eval_run_lines(n: int, every: int = 5) -> list[str]:
    """`run_lines(n)` with an `Eval:` line every `every` status lines (from the 5th) and, after
    the first, the `tau=` and `loss_b=` extras on each status line, as the trainer prints them."""
    out = ["Starting pipeline...", "Pipeline running. Monitoring..."]
    evals = 0
    for i in range(n):
        extra: dict[str, str] = {}
        if evals:
            tau = eval_event(evals - 1).tau
            extra[TAU_KEY] = f"{tau:.3f}"
        if i:
            extra[BUCKET_LOSS_KEY] = format_bucket_losses(bucket_losses(i))
        out.append(status_line(i, extras=extra))
        if i and i % every == 0:
            out.append(format_eval_line(eval_event(evals)))
            evals += 1
    return out


@dataclass
class Status:
    """Same fields as dflashctl.runs.control.RunStatus (the follower reads them by name)."""

    state: str = "running"
    exit_status: int | None = None
    release: str | None = "3f9a1c2b7d10"
    config_hash: str | None = "a1b2c3d4e5f6"
    last_event: Any = None
    run_state: contract.RunState = field(default_factory=contract.RunState)
    log_lines: int | None = None
    """None: this double does not count status.log lines (the shrink check is skipped)."""
    message: str | None = None
    supervisor: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] = field(default_factory=list)
    pane_tail: list[str] = field(default_factory=list)
    measure: RunningMeasure | None = None
    served: ServedEval | None = None
    regen: RegenJob | None = None


@dataclass
class ReplayControl:
    """A RunControl double at the service boundary: replays lines, records every call.

    Signatures match `dflashctl.runs.control.RunControl`; `fail_follow` makes the stream raise the
    given number of times first (a host whose log cannot be tailed).
    """

    lines: list[str] = field(default_factory=list)
    deployed: str = ""
    status_value: Status = field(default_factory=Status)
    calls: list[tuple[str, Any]] = field(default_factory=list)
    hold_open: bool = True
    fail_follow: int = 0
    checkpoint_text: str | None = None

    async def status(self) -> Status:
        self.calls.append(("status", None))
        return self.status_value

    def follow(
        self,
        from_line: int = 0,
        *,
        delay: Callable[[int], float] | None = None,
        max_attempts: int | None = None,
    ) -> AsyncGenerator[FollowEvent, None]:
        """The one follow loop over this double's `tail_log` (as RunControl.follow)."""
        return LogFollower(
            self, from_line, delay=delay or (lambda attempt: 0.0), max_attempts=max_attempts
        ).events()

    async def tail_log(self, from_line: int) -> AsyncIterator[str]:
        """One connection's tail from `from_line` (what `dflashctl.runs.follow.LogFollower` drives),
        recorded as a ("follow", from_line) call: a follow from that line."""
        self.calls.append(("follow", from_line))
        if self.fail_follow > 0:
            self.fail_follow -= 1
            raise ConnectionRefusedError("ssh: connect to host kpro6 port 22: Connection refused")
        for line in self.lines[from_line:]:
            yield line
        if self.hold_open:
            await asyncio.Event().wait()

    async def log_line_count(self) -> int | None:
        self.calls.append(("log_line_count", None))
        return len(self.lines)

    async def gpus(self) -> list[Any]:
        return []

    async def deployed_config(self) -> str:
        self.calls.append(("deployed_config", None))
        return self.deployed

    async def checkpoint_config(self, resume: str = "auto") -> Any:
        """The checkpoint a resume would load: saved under `checkpoint_text` (default: the
        deployed config, the usual case), None when there is no checkpoint text at all."""
        self.calls.append(("checkpoint_config", resume))
        text = self.deployed if self.checkpoint_text is None else self.checkpoint_text
        if not text:
            return None
        from dflashctl.config.runconfig import _load_text

        saved = _load_text(text, "saved.toml").model_dump(mode="json")
        return SimpleNamespace(path="run/checkpoints/step-00001200.pt", step=1200, config=saved)

    async def restart(
        self,
        fresh: bool = False,
        *,
        config: Path | None = None,
        stop_timeout: float = 120.0,
        progress: Callable[[str], None] | None = None,
    ) -> Any:
        self.calls.append(("restart", (fresh, config)))
        if progress:
            progress("deploy: release 3f9a1c2b7d10 already present")
        if config is not None:
            self.deployed = Path(config).read_text()
        return SimpleNamespace(
            stop=SimpleNamespace(checkpoint=SimpleNamespace(step=1200)),
            start=SimpleNamespace(release="3f9a1c2b7d10"),
        )

    async def stop(self, timeout: float = 120.0) -> Any:
        self.calls.append(("stop", timeout))
        self.status_value = Status(state="stopped")
        return SimpleNamespace(outcome="checkpointed")


def service(control: ReplayControl | None = None) -> RunService:
    """`control` (a fresh idle double by default) where a `RunService` is expected.

    The double is duck-typed: its `Status` mirrors `RunStatus` by field name (with `log_lines`
    None meaning "not counted") and its stop/restart results carry only the fields the app
    reads, so it is handed over as what it stands for rather than checked against it.
    """
    return cast(RunService, ReplayControl() if control is None else control)


def deploy_result(release: str, host: str = "kpro6") -> DeployResult:
    """What a deploy that switched `current` to `release` returns."""
    preflight = Preflight(
        python="3.12.3",
        modules={},
        free_bytes=1 << 40,
        gpus=[],
        release_complete=True,
        current=None,
    )
    return DeployResult(
        host=host,
        release=release,
        transferred_bytes=0,
        files=0,
        switched=True,
        previous=None,
        preflight=preflight,
    )


GROUP_INVENTORY = """
[hosts.n0]
address = "pve-a.lan"
ctid = 200
node_address = "10.0.0.10"

[hosts.n1]
address = "pve-b.lan"
ctid = 200
node_address = "10.0.0.11"

[hosts.solo]
address = "pve-c.lan"
ctid = 300

[groups.pair]
hosts = ["n0", "n1"]
"""
"""Two Proxmox nodes as one run (`pair`: n0 is node 0) and a single host beside them."""


def node_run_state(
    node_rank: int, *, step: int = 720, state: str = "running", **kw: Any
) -> contract.RunState:
    """Node `node_rank` of a 2-node, 1-rank-per-node run as its run-state.json says it (parsed by
    the contract's own parser from the JSON the trainer writes)."""
    import json

    doc = {
        "state": state,
        "world_size": 2,
        "node_rank": node_rank,
        "nnodes": 2,
        "rank_range": [node_rank, node_rank + 1],
        "step": step,
        **kw,
    }
    parsed, err = contract.parse_run_state(json.dumps(doc))
    assert err is None, err
    return parsed
