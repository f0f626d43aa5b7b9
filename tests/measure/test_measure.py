"""`python -m trainer.measure` on the tiny CPU config (issue 14 item 1): a short smoke run of
every strategy the trainer has, through the real trainer; its JSON shape, that every strategy
stepped, the calibration it saves and the planner's use of it; one-line errors. No timings are
asserted (machines are noisy): only that they exist and agree with each other."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest

from tests import budget
from trainer.bucketing.timecost import FEATURES, StepCostModel
from trainer.config import STRATEGIES
from trainer.config.overlay import dump_toml, merge

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"
KEYS = {
    "samples_s",
    "tokens_s",
    "anchor_blocks_s",
    "padded_tokens_s",
    "padding_efficiency",
    "largest_batch",
    "repeat",
    "ratio_to_sorted",
    "predicted_tokens_s",
    "predicted_samples_s",
    "prediction_error",
    "predicted_loo_tokens_s",
    "rounds",
    "flag",
}


def env() -> dict[str, str]:
    out = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    out.update({"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return out


def measure_cli(*args: str) -> subprocess.CompletedProcess[str]:
    """`python -m trainer.measure ARGS`, waited for within the test's one budget."""
    argv = [sys.executable, "-m", "trainer.measure", *args]
    return subprocess.run(
        argv,
        cwd=REPO,
        env=env(),
        capture_output=True,
        text=True,
        timeout=budget.left(),
        check=False,
    )


@pytest.fixture(scope="module")
def small_config(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny config at 1/3 the rows, its store and target at absolute paths of their own."""
    root = tmp_path_factory.mktemp("measure")
    raw = merge(
        tomllib.loads(TINY.read_text()),
        {
            "data": {"store": str(root / "store"), "synthetic": {"rows": 1000}},
            "model": {"target_dir": str(root / "target")},
            "batching": {"pool_size": 400},
        },
    )
    path = root / "tiny.toml"
    path.write_text(dump_toml(raw))
    return path


@pytest.fixture(scope="module")
def smoke_run(small_config: Path) -> subprocess.CompletedProcess[str]:
    cal = small_config.parent / "calibration.json"
    proc = measure_cli(
        "--config", str(small_config), "--steps", "4", "--warmup", "1", "--rounds", "1",
        "--window", "1", "--json", "--save-calibration", str(cal),
        "--out", str(small_config.parent / "out"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


@pytest.fixture(scope="module")
def smoke(
    smoke_run: subprocess.CompletedProcess[str], small_config: Path
) -> tuple[dict[str, Any], Path]:
    return json.loads(smoke_run.stdout), small_config.parent / "calibration.json"


def test_out_writes_the_json_and_the_table_and_progress_counts_the_runs(
    smoke_run: subprocess.CompletedProcess[str], small_config: Path
) -> None:
    """--out DIR: result.json is what --json printed, table.txt the table of the same result
    (each published by a rename: no temp file left); stderr has one progress line per run."""
    out = small_config.parent / "out"
    assert json.loads((out / "result.json").read_text()) == json.loads(smoke_run.stdout)
    table = (out / "table.txt").read_text()
    assert table.startswith(f"config {small_config}") and table.endswith("\n")
    names = [s for s in ("sorted", "bucketed", "pool-sort", "packed", "random") if s in STRATEGIES]
    for name in names:
        assert any(line.startswith(f"{name} ") for line in table.splitlines()), name
    assert sorted(p.name for p in out.iterdir()) == ["result.json", "table.txt"]
    progress = [ln for ln in smoke_run.stderr.splitlines() if ln.startswith("round ")]
    assert [ln.rsplit("(", 1)[1] for ln in progress] == [
        f"run {i} of {len(names)})" for i in range(1, len(names) + 1)
    ]


def test_an_out_dir_that_cannot_be_written_is_refused_before_any_run(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    proc = measure_cli(
        "--config", str(TINY), "--strategies", "sorted", "--steps", "3",
        "--out", str(blocker / "out"),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: --out: {blocker / 'out'}: ")
    assert proc.stderr.count("\n") == 1, proc.stderr


def test_every_strategy_stepped_and_the_json_has_the_documented_shape(
    smoke: tuple[dict[str, Any], Path],
) -> None:
    d, _ = smoke
    want = [s for s in ("sorted", "bucketed", "pool-sort", "packed", "random") if s in STRATEGIES]
    assert list(d["strategies"]) == want
    assert d["steps"] == 4 and d["warmup"] == 1 and d["rounds"] == 1
    for name, e in d["strategies"].items():
        assert set(e) >= KEYS, name
        assert len(e["rounds"]) == 1 and e["rounds"][0]["seconds"] > 0, name
        for rate in ("samples_s", "tokens_s", "anchor_blocks_s", "padded_tokens_s"):
            assert e[rate] > 0, (name, rate)
        assert e["padded_tokens_s"] >= e["tokens_s"]
        assert e["padding_efficiency"] == pytest.approx(e["tokens_s"] / e["padded_tokens_s"])
        assert 0 < e["largest_batch"] <= d["token_budget"]
        assert e["predicted_tokens_s"] > 0
        r = e["ratio_to_sorted"]["tokens_s"]
        assert r["min"] <= r["median"] <= r["max"]
        assert r["median"] == pytest.approx(e["tokens_s"] / d["strategies"]["sorted"]["tokens_s"])
    by = d["strategies"]
    assert by["sorted"]["repeat"] == 1.0  # static batches: every pair comes back
    assert by["random"]["repeat"] < 0.05
    assert by["sorted"]["ratio_to_sorted"]["tokens_s"]["median"] == 1.0
    assert set(d["calibration"]["coef"]) == set(FEATURES)


def test_the_saved_calibration_loads_and_plans_by_time(
    smoke: tuple[dict[str, Any], Path], small_config: Path
) -> None:
    d, cal = smoke
    model = StepCostModel.load(cal)
    assert model.coef == d["calibration"]["coef"] and model.points == 4 * len(d["strategies"])
    store = tomllib.loads(small_config.read_text())["data"]["store"]
    argv = [sys.executable, "-m", "trainer.buckets", "plan", "--lengths", store, "--buckets", "4"]
    argv += ["--token-budget", "1024", "--max-batch", "16", "--objective", "time"]
    argv += ["--calibration", str(cal), "--json"]
    proc = subprocess.run(argv, cwd=REPO, env=env(), capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    rates = json.loads(proc.stdout)["rates"]
    assert rates["predicted_tokens_s"] > 0 and rates["simulated_tokens_s"] > 0


def test_a_pool_holding_every_sample_is_flagged(small_config: Path) -> None:
    """--set reaches every run (a pool of 5,000 holds the 1,000 samples: flagged as sorted);
    --clock cpu rates per CPU-second and prints the wall figures beside them."""
    proc = measure_cli(
        "--config", str(small_config), "--strategies", "sorted,pool-sort", "--steps", "2",
        "--warmup", "1", "--rounds", "1", "--window", "1", "--clock", "cpu",
        "--set", "batching.pool_size=5000",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "flag: pool-sort: pool holds every sample: this is the sorted strategy" in proc.stdout
    assert "warning: pool-sort: pool_size 5,000 >= the 1,000 samples" in proc.stdout
    assert "clock: cpu (rates per CPU-second" in proc.stdout
    assert "wall: sorted " in proc.stdout and "wall: pool-sort " in proc.stdout


def test_packed_at_a_row_length_runs_that_length_and_plans_the_row_length(
    small_config: Path, tmp_path: Path
) -> None:
    """`packed@1024` is packed with batching.row_length = 1024: one row per micro-batch, fuller
    than the default rows of the longest sample (6 x 160 = 960 slots at most); the calibration
    says its CPU target attended per document, and `plan --strategy packed` chooses among the
    row lengths with it."""
    cal = tmp_path / "cal.json"
    proc = measure_cli(
        "--config", str(small_config), "--strategies", "sorted,packed,packed@1024",
        "--steps", "3", "--warmup", "1", "--rounds", "1", "--window", "1", "--json",
        "--save-calibration", str(cal),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    d = json.loads(proc.stdout)
    assert list(d["strategies"]) == ["sorted", "packed", "packed@1024"]
    assert d["document_attention"] is True
    assert d["strategies"]["packed"]["largest_batch"] <= 960
    assert 960 < d["strategies"]["packed@1024"]["largest_batch"] <= 1024
    assert StepCostModel.load(cal).meta["document_attention"] is True
    store = tomllib.loads(small_config.read_text())["data"]["store"]
    argv = [sys.executable, "-m", "trainer.buckets", "plan", "--strategy", "packed"]
    argv += ["--lengths", store, "--token-budget", "1024", "--max-batch", "16"]
    argv += ["--objective", "time", "--calibration", str(cal), "--json"]
    plan = subprocess.run(argv, cwd=REPO, env=env(), capture_output=True, text=True, check=False)
    assert plan.returncode == 0, plan.stderr
    p = json.loads(plan.stdout)
    assert p["document_attention"] is True
    best = min(p["options"], key=lambda o: (o["predicted_s"], o["row_length"]))
    assert p["row_length"] == best["row_length"]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--strategies", "sorted,bogus"], "error: --strategies: 'bogus' is not a batching"),
        (["--strategies", "sorted,sorted"], "error: --strategies: 'sorted,sorted' names a"),
        (["--steps", "0"], "error: --steps: must be >= 1, got 0"),
        (["--steps", "100000"], "error: --steps/--warmup: 5 + 100000 steps need"),
        (["--predict-with", "/nonexistent.json"], "error: --predict-with: /nonexistent.json"),
        (["--strategies", "sorted@512"], "error: --strategies: 'sorted@512': @N is a row"),
        (["--strategies", "packed@0"], "error: --strategies: 'packed@0': @N is a row length"),
        (["--strategies", "packed@"], "error: --strategies: 'packed@': @N is a row length"),
        (
            ["--strategies", "sorted,packed@2048"],
            "error: --strategies packed@2048: batching.row_length: Value error, 2048 is more",
        ),
        (
            ["--strategies", "sorted,packed@20"],
            "error: --strategies packed@20: batching: row_length 20 is shorter than sample",
        ),
    ],
)
def test_bad_flags_are_one_line_naming_the_flag(
    small_config: Path, args: list[str], needle: str
) -> None:
    base = ["--config", str(small_config), "--strategies", "sorted", "--steps", "3"]
    proc = measure_cli(*base, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(needle) and proc.stderr.count("\n") == 1, proc.stderr


def test_a_bad_config_key_is_named(tmp_path: Path) -> None:
    raw = merge(tomllib.loads(TINY.read_text()), {"batching": {"strategy": "shuffled"}})
    path = tmp_path / "bad.toml"
    path.write_text(dump_toml(raw))
    proc = measure_cli("--config", str(path), "--steps", "3")
    assert proc.returncode == 2
    assert "batching.strategy" in proc.stderr and proc.stderr.count("\n") == 1


def test_sigterm_stops_it_and_removes_the_timing_runs(small_config: Path, tmp_path: Path) -> None:
    """SIGTERM (or SIGHUP: a closed tmux session) mid-run: the timing run is killed, the
    temporary run directories (each would hold a final checkpoint) are removed, exit 143."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    argv = [sys.executable, "-m", "trainer.measure", "--config", str(small_config)]
    argv += ["--strategies", "sorted", "--steps", "160", "--warmup", "1", "--rounds", "1"]
    proc = subprocess.Popen(
        argv, cwd=REPO, env={**env(), "TMPDIR": str(tmp)}, stderr=subprocess.PIPE, text=True
    )
    try:

        def timing_run() -> bool:
            assert proc.poll() is None, proc.communicate()
            return bool(list(tmp.glob("dflash-measure-*/run-*")))

        budget.until(timing_run, "a timing run to start", every=0.2)
        time.sleep(1)  # the trainer is under way
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=budget.left())
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert err.strip().splitlines()[-1] == "error: stopped by SIGTERM"
    assert not list(tmp.glob("dflash-measure-*"))  # (torch's own caches may stay)
