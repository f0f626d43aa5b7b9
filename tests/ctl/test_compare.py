"""`dflashctl compare`: runs side by side, on real runs.

Three real tiny CPU trainings into one run directory, as a host's run/ holds them: run A
(lr 3e-3, token budget 1024, 60 steps), then `--fresh` run B (lr 1e-3, token budget 512, 60
steps), then B resumed to step 80. Held-out evaluations every 20 steps. So the log holds two
runs (the resume continues B), A trains more tokens per step than B (aligned by tokens, B's
values fall between its own evaluations), and every figure can be checked against the Eval
and status lines read independently here.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.compare.align import align, thin, value_at
from dflashctl.compare.curves import split_runs
from dflashctl.compare.sources import parse_spec, pick, read_host, read_local
from dflashctl.config.inventory import local_host
from dflashctl.errors import ExitCode, UsageError
from dflashctl.remote import LocalTransport
from tests import budget
from tests.ctl import parts as P
from trainer.config.overlay import dump_toml, merge
from trainer.events import EvalEvent, PhaseEvent, StatusEvent, parse_line

REPO = Path(__file__).resolve().parents[2]
EVERY = 20


def train(config: Path, run_dir: Path, *flags: str) -> None:
    env = {**P.tree_env(REPO), "OMP_NUM_THREADS": "1"}
    argv = [sys.executable, "-m", "trainer", "--config", str(config), "--run-dir", str(run_dir)]
    done = subprocess.run(
        [*argv, *flags], cwd=REPO, env=env, capture_output=True, text=True, timeout=budget.left()
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run directory holding run A, then run B (fresh) resumed once (see the module)."""
    root = tmp_path_factory.mktemp("compare")
    base = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    shared = {
        "data": {"store": str(root / "store"), "synthetic": {"rows": 600}},
        "model": {"target_dir": str(root / "target")},
        "status": {"interval_s": 0.5, "rate_window_s": 5.0},
        "eval": {"holdout_rows": 32, "every_steps": EVERY, "max_rows": 16},
        "checkpoint": {"every_steps": 1000, "every_minutes": 60.0},
    }
    configs = {}
    for name, lr, token_budget, steps in (
        ("a", 3e-3, 1024, 60),
        ("b", 1e-3, 512, 60),
        ("b2", 1e-3, 512, 80),
    ):
        raw = merge(
            base,
            merge(
                shared,
                {
                    "optimizer": {"lr": lr},
                    "batching": {"token_budget": token_budget},
                    "schedule": {"max_steps": steps},
                },
            ),
        )
        configs[name] = root / f"{name}.toml"
        configs[name].write_text(dump_toml(raw))
    P.build_tiny_assets(configs["a"], REPO)
    run = root / "run"
    train(configs["a"], run)
    train(configs["b"], run, "--fresh")
    train(configs["b2"], run)  # resumes B from its step-60 checkpoint
    return run


def independent(log: Path) -> list[dict[str, dict[int, tuple[float, int | None]]]]:
    """Per run (split at starts without a Resuming line), {tau, eval_loss, loss}: step ->
    (value, tokens), read from the lines here without dflashctl.compare."""
    runs: list[dict[str, dict[int, tuple[float, int | None]]]] = []
    resuming = False
    for line in log.read_text().splitlines():
        ev = parse_line(line)
        if isinstance(ev, PhaseEvent):
            if ev.phase == "resuming":
                resuming = True
            elif ev.phase == "starting":
                if not resuming:
                    runs.append({"tau": {}, "eval_loss": {}, "loss": {}})
                resuming = False
            continue
        tokens = ev.extra.get("tokens") if isinstance(ev, StatusEvent | EvalEvent) else None
        tok = int(tokens) if tokens else None
        if isinstance(ev, EvalEvent) and ev.tau is not None and ev.loss is not None:
            runs[-1]["tau"][ev.step] = (ev.tau, tok)
            runs[-1]["eval_loss"][ev.step] = (ev.loss, tok)
        elif isinstance(ev, StatusEvent) and ev.loss is not None:
            runs[-1]["loss"][ev.step] = (ev.loss, tok)
    return runs


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main(args)
    got = capsys.readouterr()
    return rc, got.out, got.err


# --- pure ------------------------------------------------------------------------------------


def test_values_between_points_are_interpolated_and_never_extrapolated() -> None:
    xy = [(0, 1.0), (10, 2.0), (30, 4.0)]
    assert value_at(xy, 10) is not None and not value_at(xy, 10).interpolated  # type: ignore[union-attr]
    mid = value_at(xy, 20)
    assert mid is not None and mid.interpolated and mid.value == pytest.approx(3.0)
    assert value_at(xy, 31) is None and value_at(xy, -1) is None
    assert thin(list(range(10)), 4) == [0, 3, 6, 9] and thin([1, 2], 5) == [1, 2]
    assert thin(list(range(10)), 1) == [9]


def test_run_specs_name_hosts_groups_and_local_copies() -> None:
    assert (parse_spec("kpro6").source, parse_spec("kpro6").back) == ("kpro6", 0)
    assert (parse_spec("kpro6~2").back, parse_spec("kpro6~2").local) == (2, False)
    s = parse_spec("./runs/a~1")
    assert (s.source, s.back, s.local) == ("./runs/a", 1, True)
    assert parse_spec("/data/b.log").local


# --- real runs -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_log_splits_into_runs_as_they_were_started(two_runs: Path) -> None:
    log = two_runs / "status.log"
    runs = split_runs(log.read_text().splitlines())
    truth = independent(log)
    assert len(runs) == len(truth) == 2  # A; B (its resume continues it)
    a, b = runs
    assert (a.resumes, b.resumes) == (0, 1)
    assert [p.step for p in a.tau] == [0, 20, 40, 60] and [p.step for p in b.tau][-1] == 80
    for got, want in zip(runs, truth, strict=True):
        assert {p.step: (p.value, p.tokens) for p in got.tau} == want["tau"]
        assert {p.step: (p.value, p.tokens) for p in got.loss} == want["loss"]
        assert got.has_tokens
    # A trains more tokens per step than B (token budget 1024 vs 512)
    assert a.tau[-1].tokens is not None and b.tau[3].tokens is not None
    assert a.tau[-1].tokens > b.tau[3].tokens  # both at step 60


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compare_two_local_runs_by_step_and_by_tokens(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    truth = independent(two_runs / "status.log")
    spec_a, spec_b = f"{two_runs}~1", str(two_runs)
    rc, out, err = cli(["compare", spec_a, spec_b], capsys)
    assert rc == 0, err
    lines = out.splitlines()
    assert lines[0].startswith(f"A = {spec_a}: run 1 of 2 in {two_runs}, steps 0-60, ")
    assert lines[1].startswith(f"B = {spec_b}: run 2 of 2 in {two_runs}, steps 0-80, ")
    assert lines[1].endswith("5 evals, resumed 1x")

    rc, out, err = cli(["compare", spec_a, spec_b, "--json"], capsys)
    doc = json.loads(out)
    by_step = doc["by_step"]
    assert by_step["problem"] is None
    assert [p["x"] for p in by_step["points"]] == [0, 20, 40, 60]  # A's evals both reached
    for point in by_step["points"]:
        for run, values in zip(truth, point["tau"], strict=True):
            assert values == {"value": run["tau"][point["x"]][0], "interpolated": False}
    # the lead at step 60 is what the Eval lines say
    tau_a, tau_b = truth[0]["tau"][60][0], truth[1]["tau"][60][0]
    lead = next(x for x in by_step["leads"] if x["metric"] == "tau")
    if tau_a != tau_b:
        assert lead["best"] == ("A" if tau_a > tau_b else "B")
        assert lead["margin"] == pytest.approx(abs(tau_a - tau_b))
    loss_lead = next(x for x in by_step["leads"] if x["metric"] == "eval_loss")
    la, lb = truth[0]["eval_loss"][60][0], truth[1]["eval_loss"][60][0]
    assert loss_lead["best"] == ("A" if la < lb else "B")
    # by tokens: B trained fewer tokens per step, so A's evaluations fall between B's
    by_tokens = doc["by_tokens"]
    assert by_tokens["problem"] is None
    b_tokens = sorted(t for _, t in truth[1]["tau"].values() if t is not None)
    xs = [p["x"] for p in by_tokens["points"]]
    assert xs[0] == 0 and xs[-1] <= b_tokens[-1]
    a_at = {t: v for v, t in truth[0]["tau"].values()}
    for point in by_tokens["points"]:
        a_val, b_val = point["tau"]
        assert a_val == {"value": a_at[point["x"]], "interpolated": False}
        assert b_val["interpolated"] == (point["x"] not in b_tokens)
    assert any(p["tau"][1]["interpolated"] for p in by_tokens["points"])

    # the text: both tables and who is ahead, '~' where B's value is interpolated
    rc, out, err = cli(["compare", spec_a, spec_b], capsys)
    text = out.split("\n\n")
    assert text[1].startswith("by step, at A's evaluations that every run reached")
    assert text[1].splitlines()[1].split()[:3] == ["step", "tau", "A"]
    assert any(line.startswith("held-out tau: ") for line in text[1].splitlines())
    assert "~" in text[2]
    # a status.log copy reads the same as the directory
    copy = tmp_path / "b.log"
    shutil.copyfile(two_runs / "status.log", copy)
    rc, again, err = cli(["compare", f"{copy}~1", str(copy), "--json"], capsys)
    assert json.loads(again)["by_step"] == by_step


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_bad_run_names_are_one_line_each(
    two_runs: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(["compare", f"{two_runs}~2", str(two_runs)], capsys)
    assert rc == ExitCode.FAILED and err.count("\n") == 1, err
    assert "holds 2 run(s); ~2 is before the first (~0 .. ~1)" in err
    rc, _, err = cli(["compare", str(tmp_path / "nope"), str(two_runs)], capsys)
    assert rc == ExitCode.FAILED and "(a run directory or its status.log)" in err
    rc, _, err = cli(["compare", str(two_runs)], capsys)
    assert rc == ExitCode.USAGE and "name at least two runs" in err
    with pytest.raises(UsageError):
        parse_spec("~1")


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_a_host_run_is_read_through_its_transport(two_runs: Path, tmp_path: Path) -> None:
    """HOST~N over a transport reads the host's run/status.log (only the lines curves are made
    of) and names the same run as the local copy."""
    host = local_host("loc", tmp_path / "wd", python=sys.executable)
    (tmp_path / "wd" / "run").mkdir(parents=True)
    shutil.copyfile(two_runs / "status.log", tmp_path / "wd" / "run" / "status.log")
    with (tmp_path / "wd" / "run" / "status.log").open("a") as f:
        f.write("Checkpoint saved: /x/step-00000080.pt\nsome other line\n")
    transport = LocalTransport()
    try:
        lines = await read_host(parse_spec("loc~1"), transport, host)
    finally:
        await transport.close()
    assert "some other line" not in lines
    remote = pick(parse_spec("loc~1"), lines)
    local = pick(parse_spec(f"{two_runs}~1"), read_local(parse_spec(f"{two_runs}~1")))
    assert remote.curves == local.curves and (remote.index, remote.count) == (1, 2)
    assert align([remote.curves, local.curves], "step").rows
    await asyncio.sleep(0)


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_compare_hosts_over_ssh(
    real_parts: P.Parts,
    clean_workdir: Path,
    two_runs: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`dflashctl compare ct~1 ct` through sshd + pct into the container's run/status.log
    equals the comparison of the local copy."""
    (clean_workdir / "run").mkdir()
    shutil.copyfile(two_runs / "status.log", clean_workdir / "run" / "status.log")
    inv = P.pinned_inventory(real_parts, tmp_path)
    rc, out, err = cli([*inv, "compare", "ct~1", "ct", "--json"], capsys)
    assert rc == 0, err
    got = json.loads(out)
    rc, local, _ = cli(["compare", f"{two_runs}~1", str(two_runs), "--json"], capsys)
    want = json.loads(local)
    assert got["by_step"] == want["by_step"] and got["by_tokens"] == want["by_tokens"]
    assert [r["source"] for r in got["runs"]] == ["ct", "ct"]
    rc, out, err = cli([*inv, "compare", "ct~5", "ct"], capsys)
    assert rc == ExitCode.FAILED and "ct holds 2 run(s); ~5 is before the first" in err
