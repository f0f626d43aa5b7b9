"""`python -m trainer.buckets plan|compare`: JSON contract, tables, and one-line errors (exit 2)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests import budget
from trainer.bucketing.compare import default_pool_size, pair_keys, repeat_share
from trainer.buckets import format_plan_table, main
from trainer.config import Strategy
from trainer.data.lengths import seed_shaped_lengths
from trainer.sampler import Batch

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def lengths_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("lengths") / "lengths.npy"
    # ~40 distinct lengths: the DP then has few candidates and the CLI tests stay fast.
    np.save(path, (seed_shaped_lengths(5_000) // 200 * 200 + 65).astype(np.int16))
    return path


def run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_plan_json_has_the_documented_keys(
    lengths_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--json prints one object whose fields agree with each other and with the data."""
    rc, out, _ = run(
        [
            "plan",
            "--lengths",
            str(lengths_file),
            "--buckets",
            "5",
            "--token-budget",
            "49152",
            "--max-batch",
            "64",
            "--json",
        ],
        capsys,
    )
    assert rc == 0
    d = json.loads(out)
    x = np.load(lengths_file).astype(np.int64)
    assert (
        len(d["boundaries"]) == 6 and d["boundaries"][0] <= x.min() < x.max() < d["boundaries"][-1]
    )
    assert sum(b["count"] for b in d["buckets"]) == len(x)
    assert sum(b["tokens"] for b in d["buckets"]) == int(x.sum()) == d["total_tokens"]
    assert abs(d["padding_efficiency"] - d["simulated_efficiency"]) < 0.005
    assert set(d["efficiency_by_k"]) >= {"1", "5", "16"}
    for b, lo, hi in zip(d["buckets"], d["boundaries"], d["boundaries"][1:], strict=False):
        assert (b["lo"], b["hi"]) == (lo, hi) and b["max"] < hi and b["mean_batch_size"] >= 1


def test_plan_table_is_what_format_plan_table_renders(
    lengths_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --json the same plan prints as the table dflashctl also uses."""
    base = [
        "plan",
        "--lengths",
        str(lengths_file),
        "--buckets",
        "3",
        "--token-budget",
        "49152",
        "--max-batch",
        "64",
    ]
    _, table, _ = run(base, capsys)
    _, js, _ = run([*base, "--json"], capsys)
    assert table.strip() == format_plan_table(json.loads(js)).strip()
    assert "padding efficiency: predicted" in table and "efficiency by K" in table


def test_compare_runs_every_strategy_side_by_side(
    lengths_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Sorted is static (pairs repeat), random pads most, bucketed sits between, none over T."""
    rc, out, _ = run(
        [
            "compare",
            "--lengths",
            str(lengths_file),
            "--token-budget",
            "49152",
            "--max-batch",
            "64",
            "--boundaries",
            "770,1216,1728,2432,3296",
            "--json",
        ],
        capsys,
    )
    assert rc == 0
    d = json.loads(out)
    by = {r["strategy"]: r for r in d["strategies"]}
    assert list(by) == ["sorted", "random", "bucketed", "pool-sort", "packed"]
    # packed (issue 14 item 5): rows padded only at their end, fresh composition every epoch
    assert by["packed"]["row_fill"] is not None and by["packed"]["row_fill"] > 0.9
    assert by["packed"]["padding_efficiency"] >= by["packed"]["row_fill"]
    assert by["packed"]["pair_repeat"] < 0.01
    assert all(by[s]["row_fill"] is None for s in ("sorted", "random", "bucketed", "pool-sort"))
    assert d["boundaries"][1:-1] == [770, 1216, 1728, 2432, 3296]
    assert by["sorted"]["pair_repeat"] == 1.0
    assert by["bucketed"]["pair_repeat"] < 0.1 and by["random"]["pair_repeat"] < 0.01
    assert by["random"]["padding_efficiency"] < by["bucketed"]["padding_efficiency"]
    assert by["bucketed"]["padding_efficiency"] < by["pool-sort"]["padding_efficiency"]
    assert all(r["largest_padded_batch"] <= 49152 for r in d["strategies"])
    assert abs(by["bucketed"]["padding_efficiency"] - d["predicted_efficiency"]) < 0.005


def test_pair_keys_count_each_co_batched_pair_once() -> None:
    """Pair hashing matches a hand count, and repeat share compares two epochs."""

    def mk(*ids: int) -> Batch:
        return Batch(np.array(ids, dtype=np.int64), 0, 1, len(ids))

    e0 = pair_keys([mk(0, 1, 2), mk(3, 4), mk(5)], n=6)
    e1 = pair_keys([mk(2, 1), mk(0, 3, 4, 5)], n=6)
    assert e0.tolist() == sorted([0 * 6 + 1, 0 * 6 + 2, 1 * 6 + 2, 3 * 6 + 4])
    assert repeat_share(e0, e1) == pytest.approx(2 / 4)  # (1,2) and (3,4) repeat


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["--lengths", "{missing}"], "--lengths: .*no such file"),
        (["--lengths", "{floats}"], "--lengths: .*non-integer length 1.5 at index 0"),
        (["--buckets", "40"], "--buckets: 40 buckets do not fit these lengths: at most 3"),
        (["--token-budget", "100"], "--token-budget: token budget 100 is smaller than the longest"),
    ],
)
def test_bad_input_exits_2_with_one_line_naming_the_flag(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    """Missing file, non-integer lengths, K too large, budget below the longest sample."""
    floats = tmp_path / "floats.npy"
    np.save(floats, np.array([1.5, 2.0]))
    good = tmp_path / "good.npy"
    np.save(good, np.array([300, 300, 500, 700, 700]))
    opts = {"--lengths": str(good), "--buckets": "2", "--token-budget": "4096", "--max-batch": "8"}
    for flag, value in zip(argv[::2], argv[1::2], strict=True):
        opts[flag] = value.format(missing=tmp_path / "nope.npy", floats=floats)
    rc, out, err = run(["plan", *[t for kv in opts.items() for t in kv]], capsys)
    assert rc == 2 and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ")
    import re

    assert re.search(needle, err), err


def test_bad_boundaries_are_named(lengths_file: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """compare --boundaries must be increasing integers."""
    rc, _, err = run(
        [
            "compare",
            "--lengths",
            str(lengths_file),
            "--token-budget",
            "49152",
            "--max-batch",
            "64",
            "--boundaries",
            "900,300",
        ],
        capsys,
    )
    assert rc == 2 and err.startswith("error: --boundaries: '900,300'")


def test_module_entry_point_runs_without_torch(tmp_path: Path) -> None:
    """`python -m trainer.buckets` works with torch unimportable (dflashctl imports it)."""
    code = (
        "import sys; sys.modules['torch'] = None; import runpy; "
        "sys.argv = ['trainer.buckets', 'plan', '--lengths', sys.argv[1], '--buckets', '2', "
        "'--token-budget', '49152', '--max-batch', '64', '--json']; "
        "runpy.run_module('trainer.buckets', run_name='__main__')"
    )
    tiny = tmp_path / "tiny.npy"
    np.save(tiny, np.array([100, 200, 300, 900, 950, 4000]))
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tiny)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=budget.left(),
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["boundaries"]) == 3


def test_compare_plans_its_own_boundaries_and_prints_a_table(
    lengths_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--buckets K plans with the DP; one epoch prints the table with diversity left blank."""
    rc, out, _ = run(
        [
            "compare",
            "--lengths",
            str(lengths_file),
            "--token-budget",
            "49152",
            "--max-batch",
            "64",
            "--buckets",
            "3",
            "--epochs",
            "1",
        ],
        capsys,
    )
    assert rc == 0
    lines = out.splitlines()
    assert "bucket boundaries=[" in lines[0] and lines[0].count(",") >= 3
    rows = {ln.split()[0]: ln for ln in lines[2:6]}
    assert list(rows) == ["sorted", "random", "bucketed", "pool-sort"]
    assert all(ln.rstrip().endswith("-") for ln in rows.values())  # no next epoch to compare
    assert "bucketed predicted by the planner" in lines[-1]


def test_compare_names_its_columns_and_warns_when_pool_sort_is_just_sorted(
    lengths_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`max batch` was padded tokens, not samples; a pool >= the data is the sorted strategy."""
    base = ["compare", "--lengths", str(lengths_file), "--token-budget", "49152"]
    base += ["--max-batch", "64", "--boundaries", "770,1216,1728,2432,3296"]
    rc, out, _ = run([*base, "--pool-size", "5000"], capsys)  # the file holds 5,000 samples
    assert rc == 0
    header = out.splitlines()[1].split()
    assert "max" in header and header[header.index("max") + 1] == "padded"
    assert "max padded = largest batch in padded tokens" in out
    assert "pairs/ep = sample pairs sharing a batch in one epoch" in out
    assert "repeat = share of one epoch's pairs that share a batch again in the next" in out
    warning = [ln for ln in out.splitlines() if ln.startswith("warning: pool-sort")]
    assert len(warning) == 1 and "5,000 samples" in warning[0] and "'sorted'" in warning[0]
    rows = {ln.split()[0]: ln for ln in out.splitlines()[2:] if ln.split()}
    assert "pool-sort*" in rows and "* = the pool holds every sample: this IS the sorted" in out
    _, js, _ = run([*base, "--pool-size", "5000", "--json"], capsys)
    d = json.loads(js)
    by = {r["strategy"]: r for r in d["strategies"]}
    assert d["warnings"] == by["pool-sort"]["warnings"] == [warning[0].removeprefix("warning: ")]
    assert by["pool-sort"]["pair_repeat"] > 0.1  # the symptom: pairs come back every epoch
    assert by["pool-sort"]["same_as_sorted"] and not by["sorted"]["same_as_sorted"]
    _, js, _ = run([*base, "--pool-size", "4999", "--json"], capsys)
    assert json.loads(js)["warnings"] == []
    assert not any(r["same_as_sorted"] for r in json.loads(js)["strategies"])


def test_the_sampler_warns_about_a_pool_holding_every_sample() -> None:
    from trainer.sampler import BatchSampler, SamplerWarning

    x = np.arange(100, 200)
    with pytest.warns(SamplerWarning, match="pool_size 100 >= the 100 samples"):
        s = BatchSampler(
            x, strategy="pool-sort", token_budget=4096, max_batch=8, seed=0, pool_size=100
        )
    assert len(s.warnings) == 1
    cases: tuple[tuple[Strategy, int], ...] = (
        ("pool-sort", 99),
        ("sorted", 100),
        ("bucketed", 10_000),
    )
    for strategy, pool in cases:
        kept = BatchSampler(
            x, strategy=strategy, token_budget=4096, max_batch=8, seed=0, pool_size=pool
        )
        assert kept.warnings == ()


def test_the_candidate_count_is_a_flag_and_the_output_says_which_search_ran(
    lengths_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--candidates N: exact when every distinct length fits, else a labelled refined grid."""
    base = ["plan", "--lengths", str(lengths_file), "--token-budget", "49152", "--max-batch", "64"]
    base += ["--buckets", "3"]
    distinct = len(np.unique(np.load(lengths_file)))
    _, out, _ = run(base, capsys)
    assert f"search: exact, every one of the {distinct} distinct lengths" in out
    _, js, _ = run([*base, "--json"], capsys)
    search = json.loads(js)["search"]
    assert search["exact"] and search["candidates"] == distinct + 1
    _, out, _ = run([*base, "--candidates", "8"], capsys)
    assert "search: GRID, not proven optimal" in out
    assert f"exact search: --candidates {distinct + 1}" in out and "grid alone:" in out
    rc, _, err = run([*base, "--candidates", "1"], capsys)
    assert rc == 2 and err.startswith("error: --candidates: must be >= 2")


def test_compare_default_pool_fits_the_data(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On a 2,679-row store the config's 3,200-sample pool would hold every sample (pool-sort
    would be sorted): without --pool-size the pool is at most a quarter of the samples, and the
    table says which pool pool-sort ran with and why."""
    path = tmp_path / "small.npy"
    np.save(path, (seed_shaped_lengths(2_679) // 200 * 200 + 65).astype(np.int16))
    base = ["compare", "--lengths", str(path), "--token-budget", "49152", "--max-batch", "64"]
    base += ["--boundaries", "770,1216,1728,2432,3296"]
    rc, out, _ = run(base, capsys)
    assert rc == 0
    assert "pool-sort pool = 669 samples (default: 3,200, at most 1/4 of the 2,679 samples)" in out
    assert "pool-sort*" not in out and "warning: pool-sort" not in out
    _, js, _ = run([*base, "--json"], capsys)
    d = json.loads(js)
    assert d["pool_size"] == 669 and d["pool_size_default"] is True and d["warnings"] == []
    # a pool given explicitly is used as given, and named without the default's note
    rc, out, _ = run([*base, "--pool-size", "3200"], capsys)
    assert "pool-sort pool = 3,200 samples\n" in out and "pool-sort*" in out
    # large data keeps the config's pool
    assert default_pool_size(1_000_000) == 3200 and default_pool_size(3) == 1
