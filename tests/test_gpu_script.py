"""benchmarks/gpu.sh cannot rot between GPU loans: its --smoke mode runs every step on the CPU.

The real script runs only where a GPU is lent (rarely, for ~15 minutes), so CI runs the same
script, the same steps and the same record writing at tiny sizes, and checks that a failing or
hanging step is recorded without taking the others down.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests import budget

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "gpu.sh"
STEPS = ["doctor", "env", "drafter", "kernel-tests", "pipeline", "capture", "ce", "measure"]


def _gpu_steps() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_steps", REPO / "benchmarks" / "gpu_steps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_steps"] = module
    spec.loader.exec_module(module)
    return module


gpu_steps = _gpu_steps()


def _env(out: Path, **env: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_SH_", "DFLASH_"))}
    base.pop("TRITON_INTERPRET", None)
    base.update(OUT=str(out), PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    return base


def _run(out: Path, **env: str) -> subprocess.CompletedProcess[str]:
    """gpu.sh --smoke under one overall budget (GPU_SH_BUDGET: what is left of the test's, less
    the time gpu.sh takes to kill a step and write its record) instead of the smoke boxes, which
    were sized for an idle machine: a loaded one fails no step that is merely slow."""
    overall = budget.left()
    env.setdefault("GPU_SH_BUDGET", str(max(int(overall) - 15, 1)))
    return subprocess.run(
        ["bash", str(SCRIPT), "--smoke"],
        cwd=REPO,
        env=_env(out, **env),
        capture_output=True,
        text=True,
        timeout=overall,
    )


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def _step_report(out: Path, name: str) -> str:
    """What step `name` left, for a failure message: its steps.jsonl line, its last record and
    the tail of its part of gpu.log (between `== name (timeout` and `== name: exit`)."""
    steps = [s for s in _jsonl(out / "steps.jsonl") if s["step"] == name]
    recs = [r for r in _jsonl(out / "results.jsonl") if r["step"] == name]
    log = (out / "gpu.log").read_text() if (out / "gpu.log").is_file() else ""
    start = log.find(f"== {name} (timeout")
    part = log[start : log.find(f"== {name}: exit", start) + 200] if start >= 0 else ""
    return (
        f"step {name}: {steps[-1] if steps else 'no steps.jsonl line (gpu.sh never ran it)'}; "
        f"last record: {recs[-1] if recs else None}; gpu.log:\n{part[-3000:]}"
    )


def _records(out: Path, name: str) -> list[dict[str, Any]]:
    """Step `name`'s records; none is a failure that says what the step itself reported."""
    recs = [r for r in _jsonl(out / "results.jsonl") if r["step"] == name]
    assert recs, f"step {name} wrote no record: {_step_report(out, name)}"
    return recs


def _by_step(records: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        out.setdefault(rec["step"], []).append(rec)
    return out


@pytest.mark.timeout(480)
def test_smoke_run_records_every_step_with_exit_0(tmp_path: Path) -> None:
    """Every step runs in order, exits 0 and leaves its start, measurements and done records."""
    proc = _run(tmp_path)
    steps = _jsonl(tmp_path / "steps.jsonl")
    for step in steps:  # a failed step says what it reported, before anything else is checked
        assert step["rc"] == 0 and step["timed_out"] is False, _step_report(tmp_path, step["step"])
    assert [s["step"] for s in steps] == STEPS, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {name: _records(tmp_path, name) for name in STEPS}
    assert list(_by_step(_jsonl(tmp_path / "results.jsonl"))) == STEPS
    for name, recs in results.items():
        assert recs[0]["kind"] == "start" and recs[0]["smoke"] is True, name
        assert recs[-1]["kind"] == "done" and recs[-1]["ok"] is True, _step_report(tmp_path, name)
    kinds = {name: [r["kind"] for r in recs] for name, recs in results.items()}
    doctor = [(r["stage"], r["status"]) for r in results["doctor"] if r["kind"] == "stage"]
    assert doctor == [
        ("alloc", "ok"),
        ("attention", "skipped"),
        ("ce", "skipped"),
        ("step", "ok"),
        ("copy", "skipped"),
        ("nccl", "skipped"),
    ]
    facts = next(r for r in results["env"] if r["kind"] == "facts")
    assert facts["torch"] and facts["default_dtype"] == "torch.float32"
    rungs = [r for r in results["drafter"] if r["kind"] == "rung"]
    assert [r["query_rows"] for r in rungs] == sorted({r["query_rows"] for r in rungs})
    assert len(rungs) == len(gpu_steps.SMOKE_RUNGS) and all(r["ms_step"] > 0 for r in rungs)
    cases = {r["case"]: r for r in results["drafter"] if r["kind"] == "case"}
    assert list(cases) == ["one-pass", "split", "checkpointed"]
    assert cases["split"]["pieces"] > 1 and cases["one-pass"]["pieces"] == 1
    # memory-bounded steps, measured (CPU allocator events): split and checkpointed keep less
    one_pass = cases["one-pass"]["peak_above_base_bytes"]
    assert cases["split"]["peak_above_base_bytes"] < 0.75 * one_pass
    assert cases["checkpointed"]["peak_above_base_bytes"] < one_pass
    pytest_rec = next(r for r in results["kernel-tests"] if r["kind"] == "pytest")
    assert pytest_rec["rc"] == 0 and pytest_rec["tests"] > 0 and pytest_rec["failures"] == 0
    resume = next(r for r in results["pipeline"] if r["kind"] == "resume")
    assert resume["losses_equal"] and resume["drafter_equal"], resume
    assert kinds["capture"].count("shape") == 2
    assert kinds["ce"].count("kernel") == 3
    # measure: `python -m trainer.measure` through the box, one record per strategy and the fit
    by = {r["strategy"]: r for r in results["measure"] if r["kind"] == "strategy"}
    assert list(by) == ["sorted", "packed"]
    assert all(r["tokens_s"] > 0 and r["predicted_tokens_s"] > 0 for r in by.values())
    assert by["sorted"]["ratio_to_sorted"]["median"] == 1.0
    fit = next(r for r in results["measure"] if r["kind"] == "calibration")
    assert fit["points"] > 0 and all(v >= 0 for v in fit["coef"].values())
    log = (tmp_path / "gpu.log").read_text()
    assert all(f"== {name}: exit 0" in log for name in STEPS)


def test_the_measure_steps_strategies_can_be_chosen(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPU_SH_MEASURE_STRATEGIES reaches trainer.measure's --strategies (packed@N included),
    on the GPU run and in the smoke; unset, the GPU run measures every strategy."""
    cfg, cal = Path("run.toml"), Path("cal.json")
    monkeypatch.delenv("GPU_SH_MEASURE_STRATEGIES", raising=False)
    assert "--strategies" not in gpu_steps.measure_argv(False, cfg, cal, 20, 5, 2)
    smoke = gpu_steps.measure_argv(True, cfg, cal, 3, 1, 1)
    assert smoke[smoke.index("--strategies") + 1] == "sorted,packed"
    monkeypatch.setenv("GPU_SH_MEASURE_STRATEGIES", "sorted,packed@8192")
    for smoke_run in (False, True):
        argv = gpu_steps.measure_argv(smoke_run, cfg, cal, 20, 5, 2)
        assert argv[argv.index("--strategies") + 1] == "sorted,packed@8192"
        assert argv[argv.index("--config") + 1] == "run.toml" and "--json" in argv


STALL_BOX_SCALE = 4
"""The stalled step's box, in multiples of a measured start-up (see `_stall_box`)."""


def _stall_box(tmp_path: Path) -> int:
    """The box the stalled step is killed by: the feature under test, so derived from measured
    work, not a fixed 3 s that a loaded machine spends before the step's first record. A step
    started with --fail does what --stall does up to its sleep (Python start-up, gpu_steps'
    imports, the start record) and then exits: STALL_BOX_SCALE times its wall time, at least
    the 3 s an idle machine needs, leaves the stalled step time to write its start record and
    still kills it by the box."""
    out = tmp_path / "startup"
    argv = [sys.executable, str(REPO / "benchmarks" / "gpu_steps.py"), "capture", "--smoke"]
    t0 = time.monotonic()
    proc = subprocess.run(
        [*argv, "--fail", "--out", str(out)],
        cwd=REPO,
        env=_env(out),
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )
    seconds = time.monotonic() - t0
    assert proc.returncode == 1 and [r["kind"] for r in _jsonl(out / "results.jsonl")] == [
        "start",
        "error",
    ], proc.stderr[-3000:]
    return max(3, math.ceil(STALL_BOX_SCALE * seconds))


@pytest.mark.timeout(120)
def test_a_failing_and_a_hanging_step_are_recorded_and_the_rest_still_runs(
    tmp_path: Path,
) -> None:
    """env raises, capture hangs past its box (killed: 124), ce after them still runs; the
    script exits 1 only after the last step."""
    box = _stall_box(tmp_path)
    out = tmp_path / "run"
    proc = _run(
        out,
        GPU_SH_STEPS="env,capture,ce",
        GPU_SH_FAIL_STEP="env",
        GPU_SH_STALL_STEP="capture",
        GPU_SH_STALL_TIMEOUT=str(box),
    )
    steps = {s["step"]: s for s in _jsonl(out / "steps.jsonl")}
    assert list(steps) == ["env", "capture", "ce"], proc.stdout[-3000:] + proc.stderr[-3000:]
    assert steps["env"]["rc"] == 1 and not steps["env"]["timed_out"], _step_report(out, "env")
    assert steps["capture"]["rc"] == 124 and steps["capture"]["timed_out"]
    assert steps["capture"]["timeout_s"] == box
    assert steps["ce"]["rc"] == 0, _step_report(out, "ce")
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    env_recs = _records(out, "env")
    assert env_recs[-1]["kind"] == "error" and "on purpose" in env_recs[-1]["error"]
    capture = [r["kind"] for r in _records(out, "capture")]
    assert capture == ["start"], _step_report(out, "capture")  # killed: no done record
    assert _records(out, "ce")[-1]["kind"] == "done", _step_report(out, "ce")


class _Rec:
    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []

    def __call__(self, kind: str, **fields: Any) -> dict[str, Any]:
        self.records.append({"kind": kind, **fields})
        return self.records[-1]


def _ctx(rec: _Rec, left: float = 1e6) -> Any:
    return gpu_steps.Ctx(smoke=True, rec=rec, deadline=time.monotonic() + left)


def test_ladder_stops_at_the_first_oom_and_keeps_what_fitted() -> None:
    import torch

    calls: list[int] = []

    def rung(r: int) -> dict[str, Any]:
        calls.append(r)
        if r >= 3:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 80 GiB")
        return {"rows": r}

    rec = _Rec()
    summary = gpu_steps.run_ladder([1, 2, 3, 4], rung, _ctx(rec), cost=float)
    assert calls == [1, 2, 3]  # nothing after the OOM
    assert summary == {"largest_fitted": 2, "failed_rung": 3, "ended": "oom"}
    assert [r["kind"] for r in rec.records] == ["rung", "rung", "oom"]
    assert "Tried to allocate" in rec.records[-1]["error"]


def test_ladder_other_errors_propagate() -> None:
    def rung(r: int) -> dict[str, Any]:
        raise ValueError("a real bug, not memory")

    with pytest.raises(ValueError, match="real bug"):
        gpu_steps.run_ladder([1], rung, _ctx(_Rec()), cost=float)


def test_ladder_skips_a_rung_predicted_past_the_budget() -> None:
    def rung(r: int) -> dict[str, Any]:
        time.sleep(0.05 * r)
        return {}

    rec = _Rec()
    # rung 1 takes ~0.05 s; rung 100 is predicted at ~5 s, more than the 1 s left
    summary = gpu_steps.run_ladder([1, 100], rung, _ctx(rec, left=1.0), cost=float)
    assert summary == {"largest_fitted": 1, "failed_rung": None, "ended": "budget"}
    assert [r["kind"] for r in rec.records] == ["rung", "skipped"]


def test_ladder_predicts_from_the_steady_time_not_the_compile() -> None:
    """The first rung's wall time includes compilation; the prediction uses the steady time
    the rung reports, so a slow first compile does not end the ladder at its first rung."""

    def rung(r: int) -> dict[str, Any]:
        if r == 1:
            time.sleep(0.3)  # "compiling"
        return {"steady_s": 0.001 * r}

    rec = _Rec()
    # from rung 1's wall time (>= 0.3 s) rung 100 would be predicted at >= 30 s, past the 15 s
    # left; from its steady time at 0.1 s. A loaded machine only makes the wall time longer.
    summary = gpu_steps.run_ladder([1, 100], rung, _ctx(rec, left=15.0), cost=float)
    assert summary == {"largest_fitted": 100, "failed_rung": None, "ended": "top"}
    assert [r["kind"] for r in rec.records] == ["rung", "rung"]
    assert "steady_s" not in rec.records[0]


def test_the_gpu_sizes_are_valid_configs(tmp_path: Path) -> None:
    """What only the GPU run builds is still checked here: the real pipeline config validates,
    the real drafter config is the seed's shape, and the ladder grows."""
    from trainer.config import TrainConfig

    cfg = TrainConfig.from_dict(gpu_steps.pipeline_config(tmp_path, smoke=False, steps=24))
    assert cfg.topology.target_devices == ["cuda:0"] and cfg.model.drafter.block_size == 16
    assert cfg.checkpoint.every_steps == 12 and cfg.schedule.max_steps == 24
    assert cfg.model.max_query_rows == 4096  # packets of up to 32 x 64 x 16 rows get split
    dcfg = gpu_steps.drafter_config(gpu_steps.REAL_DRAFTER)
    assert dcfg.target_layer_ids == [1, 9, 17, 25, 33] and dcfg.vocab_size == 151_936
    rows = [r * a * dcfg.block_size for r, _, a in gpu_steps.REAL_RUNGS]
    assert rows == sorted(rows) and rows[-1] >= 524_288  # past the seed's worst step
    assert all(r >= 2 for r, _, _ in gpu_steps.REAL_RUNGS)  # no size-1 recompile


def test_the_gpu_boxes_sum_to_under_13_minutes_and_match_the_header() -> None:
    """The real run's time boxes (first argument of each `s GPU SMOKE`) stay under 780 s (the
    six issue-16 steps under 480 s; the doctor first, issue 26, and measure on top: issue 14's
    table on CUDA), and the header's table and total state the same numbers, in the same order."""
    import re

    text = SCRIPT.read_text()
    boxes = re.findall(r'^run_step ([a-z-]+) "\$\(s (\d+) \d+\)"', text, re.M)
    assert [name for name, _ in boxes] == STEPS
    total = sum(int(t) for _, t in boxes)
    assert total <= 780
    assert sum(int(t) for name, t in boxes if name not in ("measure", "doctor")) <= 480
    header = re.findall(r"^#   ([a-z-]+) \[(\d+)\]", text, re.M)
    assert header == boxes
    assert f"# Boxes: {total} s in all" in text


def test_the_carried_wheels_are_the_locks_pins_and_cover_pydantics_needs() -> None:
    """gpu_wheels.sh fetches what the GPU image lacks: pydantic and everything it requires,
    at requirements.lock's versions (checked offline against the installed pydantic)."""
    import re
    from importlib.metadata import requires

    proc = subprocess.run(
        ["bash", str(REPO / "benchmarks" / "gpu_wheels.sh"), "--dry-run"],
        capture_output=True,
        text=True,
        timeout=budget.left(),
        check=True,
    )
    specs = proc.stdout.split()
    lock = (REPO / "requirements.lock").read_text().splitlines()
    assert all(spec in lock for spec in specs), specs

    def norm(name: str) -> str:
        return re.sub(r"[-_.]+", "-", name).lower()

    fetched = {norm(spec.split("==")[0]) for spec in specs}
    needed = {
        norm(re.split(r"[ ;<>=!~\[]", req, maxsplit=1)[0])
        for req in requires("pydantic") or []
        if "extra ==" not in req
    }
    assert {"pydantic", *needed} <= fetched, needed - fetched
