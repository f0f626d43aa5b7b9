"""The supervisor on the tiny CPU run: how fast a killed trainer trains again, and what it costs.

1. Restart latency: `python -m trainer.supervise --backoff-s B -- python -m trainer ...`; after
   each attempt has checkpointed, `kill -9` the trainer and time, from the kill, (a) the
   supervisor's "Restarting trainer:" line and (b) the first status line whose step is past the
   resumed checkpoint. Side by side, the same resume without a supervisor: a plain
   `python -m trainer --resume auto` started by this script, timed from its start to its first
   new step, interleaved trial by trial with the supervised kills (same machine load). The
   difference is what the supervisor adds (poll tick + backoff B).
2. Cost while training: the supervisor's CPU seconds per wall second and its RSS, next to the
   trainer's, over a steady interval with no kills (from /proc/PID/stat and /proc/PID/status).

Status lines every 0.2 s, so a time to "first new step" is up to 0.2 s late, equally for both.
Run:
    .venv/bin/python benchmarks/bench_supervise.py [--kills 5] [--backoff-s 0.1]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import TrainConfig  # noqa: E402
from trainer.config.overlay import dump_toml, merge  # noqa: E402
from trainer.events import (  # noqa: E402
    CheckpointEvent,
    Event,
    PhaseEvent,
    StatusEvent,
    parse_line,
)
from trainer.supervision import procinfo  # noqa: E402

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def _config(root: Path) -> Path:
    raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    raw = merge(
        raw,
        {
            "data": {"store": str(root / "store")},
            "model": {"target_dir": str(root / "target")},
            "batching": {"token_budget": 512, "max_batch": 8},
            "status": {"interval_s": 0.2, "rate_window_s": 5.0},
            "checkpoint": {"every_steps": 5, "every_minutes": 600.0, "keep_last": 2},
            "schedule": {"max_steps": 1_000_000},
        },
    )
    from trainer.pipeline import assets

    cfg = TrainConfig.from_dict(raw)
    assets.ensure_store(cfg)
    assets.ensure_target(cfg)
    path = root / "run.toml"
    path.write_text(dump_toml(raw))
    return path


class Log:
    """status.log read incrementally, parsed events with their arrival time."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.partial = path, 0, b""

    def new(self) -> list[Event]:
        try:
            with open(self.path, "rb") as fh:
                fh.seek(self.offset)
                data = fh.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *lines, self.partial = (self.partial + data).split(b"\n")
        return [parse_line(x.decode()) for x in lines]


def _first_new_step(log: Log, deadline: float) -> tuple[float | None, float]:
    """Wait for a resume/start line, then a status line past it: (restart line time, step time)."""
    base: int | None = None
    restart_at: float | None = None
    while time.monotonic() < deadline:
        for ev in log.new():
            now = time.monotonic()
            if isinstance(ev, PhaseEvent) and ev.phase == "restarting":
                restart_at = now
            elif isinstance(ev, PhaseEvent) and ev.phase == "resuming":
                base = int(ev.detail.split(" ", 1)[0].removeprefix("step="))
            elif isinstance(ev, StatusEvent) and base is not None and ev.step > base:
                return restart_at, now
        time.sleep(0.01)
    raise SystemExit("no new step within the deadline")


def _wait_checkpoint(log: Log, deadline: float) -> None:
    while time.monotonic() < deadline:
        if any(isinstance(ev, CheckpointEvent) for ev in log.new()):
            return
        time.sleep(0.01)
    raise SystemExit("no checkpoint within the deadline")


def _cpu(pid: int) -> float:
    seconds = procinfo.cpu_seconds(pid)
    if seconds is None:
        raise SystemExit(f"no CPU time for pid {pid} (it exited?)")
    return seconds


def _rss(pid: int) -> tuple[int, int]:
    kib = procinfo.rss_kib(pid)
    if kib is None:
        raise SystemExit(f"no memory figures for pid {pid} (it exited?)")
    return kib


def _trainer_pid(run: Path) -> int:
    return int(json.loads((run / "supervisor.json").read_text())["trainer_pid"])


def _p50(xs: list[float]) -> str:
    return f"{statistics.median(xs):6.2f} s (min {min(xs):.2f}, max {max(xs):.2f})"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--backoff-s", type=float, default=0.1)
    ap.add_argument("--steady-s", type=float, default=20.0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        cfg = _config(root)
        run = root / "run"
        trainer = [sys.executable, "-m", "trainer", "--config", str(cfg), "--run-dir", str(run)]
        sup_argv = [
            sys.executable, "-m", "trainer.supervise", "--backoff-s", str(args.backoff_s),
            "--", *trainer,
        ]  # fmt: skip
        to_line, to_step, plain = [], [], []
        cost: tuple[float, float, float, tuple[int, int], tuple[int, int]] | None = None
        # Interleaved, so both ways see the same machine load: per trial, a supervised kill -9
        # and restart, then a plain start by hand on the same run directory.
        for trial in range(args.kills):
            out = open(root / "sup.out", "a")  # noqa: SIM115
            sup = subprocess.Popen(sup_argv, cwd=REPO, env=ENV, stdout=out, stderr=out)
            log = Log(run / "status.log")
            log.new()
            try:
                _wait_checkpoint(log, time.monotonic() + 300)
                if trial == 0:  # cost while training: the first attempt, no kills
                    tpid = _trainer_pid(run)
                    c0 = _cpu(sup.pid), _cpu(tpid), time.time()
                    time.sleep(args.steady_s)
                    c1 = _cpu(sup.pid), _cpu(tpid), time.time()
                    wall = c1[2] - c0[2]
                    rss = _rss(sup.pid), _rss(tpid)
                    cost = (wall, (c1[0] - c0[0]) / wall, (c1[1] - c0[1]) / wall, *rss)
                    _wait_checkpoint(log, time.monotonic() + 120)
                os.kill(_trainer_pid(run), signal.SIGKILL)
                killed = time.monotonic()
                restart_at, step_at = _first_new_step(log, killed + 120)
                if restart_at is not None:
                    to_line.append(restart_at - killed)
                to_step.append(step_at - killed)
            finally:
                sup.send_signal(signal.SIGINT)
                sup.wait(120)
                out.close()
            log = Log(run / "status.log")
            log.new()
            started = time.monotonic()
            p = subprocess.Popen(
                trainer, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
            )
            _, step_at = _first_new_step(log, started + 120)
            plain.append(step_at - started)
            p.send_signal(signal.SIGINT)
            p.wait(120)
    print(f"restart latency, tiny CPU config, {args.kills} trials, backoff {args.backoff_s:g} s")
    print(f"  kill -9 -> 'Restarting trainer:' line  p50 {_p50(to_line)}")
    print(f"  kill -9 -> first new step              p50 {_p50(to_step)}")
    print(f"  plain start -> first new step (no sup) p50 {_p50(plain)}")
    print(
        f"  supervised / plain (p50)                {statistics.median(to_step) / statistics.median(plain):.2f}x"
    )
    assert cost is not None
    wall, sup_cpu, trn_cpu, sup_rss, trn_rss = cost
    print(f"cost while training ({wall:.0f} s steady, no kills)")
    print(f"  supervisor CPU {sup_cpu * 100:.2f}% of a core; trainer {trn_cpu * 100:.0f}%;"
          f" ratio {sup_cpu / trn_cpu:.4f}")  # fmt: skip
    print(f"  supervisor RSS {sup_rss[0] / 1024:.1f} MiB (peak {sup_rss[1] / 1024:.1f});"
          f" trainer RSS {trn_rss[0] / 1024:.0f} MiB")  # fmt: skip


if __name__ == "__main__":
    main()
