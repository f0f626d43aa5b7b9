"""`dflashctl measure HOST`: trainer.measure in the host's container, in a tmux session of its
own, followed or detached, its result printed and its calibration fetched; refused while
training or another measure runs there; and the other way round, start, restart and a group's
start refused while it runs, and status showing it.

Pure tests of the request, the argv and the status parser; the service over LocalTransport with
real tmux and a stand-in trainer.measure (fast: refusals, follow, detach, --result, --stop, a
measure that exits 2 or is lost); and the CLI over the real sshd + pct shim + LXC + tmux running
the real trainer.measure on the tiny config.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.cli.status_text import format_run_status
from dflashctl.config.inventory import GroupConfig, HostConfig, local_host
from dflashctl.errors import ExitCode, UsageError
from dflashctl.groups.control import GroupControl
from dflashctl.releases.deploy import deploy
from dflashctl.releases.release import build_release
from dflashctl.remote import LocalTransport
from dflashctl.remote.layout import RemoteLayout, measure_session
from dflashctl.remote.run import MARK
from dflashctl.runs.control import RunControl
from dflashctl.runs.detached import error_line
from dflashctl.runs.follow import Backoff
from dflashctl.runs.measure import (
    MeasureBusy,
    MeasureControl,
    MeasureError,
    MeasureRefused,
    MeasureRequest,
    check_local_target,
    how_far,
    measure_argv,
    outcome_error,
    overrides,
    parse_measure_status,
    parse_strategies,
)
from dflashctl.runs.service import MeasureInProgress
from dflashctl.runs.snapshot import iso_utc, measure_started
from tests import budget
from tests.conftest import require_part
from tests.ctl import parts as P

REPO = Path(__file__).resolve().parents[2]
STANDIN = Path(__file__).resolve().parent / "standin"

# --- pure ------------------------------------------------------------------------------------


def test_the_request_becomes_trainer_measures_flags_and_its_argv() -> None:
    req = MeasureRequest(
        steps=20,
        warmup=3,
        rounds=2,
        strategies=("sorted", "packed"),
        clock="cpu",
        sets=("batching.pool_size=400",),
    )
    req.check()
    argv = measure_argv("/usr/bin/python3", RemoteLayout("/srv/d"), "20261201T170211Z", req)
    assert argv == [
        "/usr/bin/python3", "-m", "trainer.measure", "--config", "/srv/d/run/config.toml",
        "--steps", "20", "--strategies", "sorted,packed", "--warmup", "3", "--rounds", "2",
        "--clock", "cpu", "--set", "batching.pool_size=400",
        "--out", "/srv/d/measure/20261201T170211Z",
        "--save-calibration", "/srv/d/measure/20261201T170211Z/calibration.json",
    ]  # fmt: skip
    assert MeasureRequest(steps=5).flags() == ["--steps", "5"]  # the rest: trainer.measure's


@pytest.mark.parametrize(
    ("req", "said"),
    [
        (MeasureRequest(steps=0), "--steps 0: must be >= 1"),
        (MeasureRequest(steps=4, warmup=-1), "--warmup -1: must be >= 0"),
        (MeasureRequest(steps=4, rounds=0), "--rounds 0: must be >= 1"),
        (MeasureRequest(steps=4, window=5), "--window 5: must be <= --steps (4)"),
        (MeasureRequest(steps=4, clock="sun"), "--clock 'sun': one of wall, cpu"),
        (MeasureRequest(steps=4, sets=("pool_size",)), "--set 'pool_size': not KEY=VALUE"),
        (MeasureRequest(steps=4, sets=("a..b=1",)), "--set 'a..b=1': not KEY=VALUE"),
        (MeasureRequest(steps=4, sets=("a=1", "a.b=2")), "--set 'a.b=2': a is set to a value"),
    ],
)
def test_a_bad_request_is_one_line_naming_the_flag(req: MeasureRequest, said: str) -> None:
    with pytest.raises(UsageError) as got:
        req.check()
    assert str(got.value).startswith(said) and "\n" not in str(got.value)


def test_strategies_and_sets_parse_as_trainer_measure_reads_them() -> None:
    assert parse_strategies("sorted, packed") == ("sorted", "packed")
    assert parse_strategies("packed,packed@1024") == ("packed", "packed@1024")  # row length
    for bad, said in (
        ("sorted,,packed", "comma-separated"),
        ("a,a", "twice"),
        ("So rt", "name"),
        ("packed@", "name"),
        ("packed@1x", "name"),
    ):
        with pytest.raises(UsageError, match=said):
            parse_strategies(bad)
    assert overrides(["batching.pool_size=400", "batching.strategy=packed", "x.y=[1, 2]"]) == {
        "batching": {"pool_size": 400, "strategy": "packed"},
        "x": {"y": [1, 2]},
    }


def sections(**parts: str) -> str:
    return "".join(f"{MARK}{k}\n{v}\n" for k, v in parts.items())


def test_the_status_parser_tells_every_state_apart() -> None:
    live, dead = "0|||412", "1|0||412"
    base = {"now": "1796144000", "current": "releases/abc123", "measurable": "yes"}

    def st(**kw: str) -> str:
        return parse_measure_status("h", "/srv/d", sections(**{**base, **kw})).state

    assert st(id="") == "none"
    assert st(id="20261201T170211Z", pane=live) == "running"
    assert st(id="20261201T170211Z", pane=dead, exit="0") == "finished"
    assert st(id="20261201T170211Z", pane=dead, exit="2") == "failed"
    assert st(id="20261201T170211Z", pane="") == "lost"  # no exit status, no session
    assert st(id="20261201T170211Z", pane="", cancelled="2026-12-01T17:05:00Z") == "cancelled"
    assert st(id="../../etc") == "none"  # only ids of the measure format are read
    got = parse_measure_status(
        "h",
        "/srv/d",
        sections(**base, id="20261201T170211Z", pane=live, progress="round 1/2 a: 1 tok/s\x1b[31m"),
    )
    assert got.release == "abc123" and got.measurable and got.directory.endswith("T170211Z")
    assert got.progress == ["round 1/2 a: 1 tok/s"]  # remote text made safe where it enters
    assert got.since().startswith("since 2026-12-01 17:02:11 UTC, ")
    assert parse_measure_status("h", "/d", f"{MARK}noworkdir\n").state == "none"


def test_outcomes_pass_the_measures_own_line_through_naming_the_host() -> None:
    text = sections(id="20261201T170211Z", pane="1|2||9", exit="2")
    st = parse_measure_status("h", "/d", text)
    err = outcome_error(st, ["error: --strategies: 'x' is not a batching strategy"])
    assert isinstance(err, MeasureRefused) and err.exit_code == ExitCode.USAGE
    assert str(err) == "h: trainer.measure: --strategies: 'x' is not a batching strategy"
    failed = parse_measure_status("h", "/d", sections(id="20261201T170211Z", exit="1"))
    err = outcome_error(failed, ["Traceback ...", "error: trainer run 0-a exited 1: ERROR: oom"])
    assert str(err) == "h: measure 20261201T170211Z failed: trainer run 0-a exited 1: ERROR: oom"
    assert error_line([], 137) == "exit status 137"
    assert how_far([]) == "no timing run has finished yet"
    assert how_far([f"round 1/1 s{i}: 1 tok/s (run {i} of 5)" for i in range(5)]).count(";") == 2


def test_a_calibration_file_that_cannot_be_written_is_refused_up_front(tmp_path: Path) -> None:
    check_local_target(tmp_path / "cal.json")
    for bad, said in ((tmp_path, "is a directory"), (tmp_path / "no" / "c.json", "no directory")):
        with pytest.raises(UsageError, match=said):
            check_local_target(bad)


# --- the service over LocalTransport, real tmux, a stand-in trainer.measure -------------------

STANDIN_MEASURE = '''"""`python -m trainer.measure` stand-in: the flags dflashctl passes, one progress line per
timing run (`pause = S` in the config: seconds per run), --out and --save-calibration files."""
import argparse, json, os, re, sys, time

p = argparse.ArgumentParser()
for flag in ("--config", "--steps", "--warmup", "--window", "--clock", "--out", "--save-calibration"):
    p.add_argument(flag)
p.add_argument("--strategies", default="sorted,packed")
p.add_argument("--rounds", type=int, default=1)
p.add_argument("--set", action="append", default=[])
p.add_argument("--json", action="store_true")
a = p.parse_args()
names = a.strategies.split(",")
if "bogus" in names:
    print("error: --strategies: 'bogus' is not a batching strategy", file=sys.stderr)
    sys.exit(2)
m = re.search(r"pause = ([0-9.]+)", open(a.config).read())
pause = float(m.group(1)) if m else 0.1
total, done = a.rounds * len(names), 0
for r in range(a.rounds):
    for s in names:
        time.sleep(pause)
        done += 1
        print(f"round {r + 1}/{a.rounds} {s}: 1,000 tok/s (run {done} of {total})", file=sys.stderr, flush=True)
result = {"strategies": {s: {"tokens_s": 1000.0} for s in names}, "steps": int(a.steps), "set": a.set}
table = "\\n".join([f"config {a.config}", *(f"{s} 1.00k" for s in names), "\\x1b]0;PWNED\\x07end"])
os.makedirs(a.out, exist_ok=True)
open(os.path.join(a.out, "result.json"), "w").write(json.dumps(result))
open(os.path.join(a.out, "table.txt"), "w").write(table + "\\n")
open(a.save_calibration, "w").write(json.dumps({"version": 1, "coef": {"fixed": 0.01}}))
print(json.dumps(result) if a.json else table)
'''


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[tuple[MeasureControl, HostConfig, Path]]:
    """A local "container" with the stand-in trainer (tests/ctl/standin) and a stand-in
    trainer.measure deployed, a run config of 0.3 s per timing run; its own tmux server."""
    require_part(shutil.which("tmux") is not None, "tmux not installed")
    sock = tmp_path / "tmux"
    sock.mkdir()
    transport = LocalTransport(env={"TMUX_TMPDIR": str(sock), "STANDIN_PERIOD": "0.1"})
    host = local_host("loc", tmp_path / "wd", python=sys.executable, session="t")
    tree = tmp_path / "tree"
    shutil.copytree(STANDIN, tree, ignore=shutil.ignore_patterns("__pycache__"))
    (tree / "trainer" / "measure").mkdir()
    (tree / "trainer" / "measure" / "__init__.py").write_text("")
    (tree / "trainer" / "measure" / "__main__.py").write_text(STANDIN_MEASURE)
    await deploy(transport, host, release=build_release(tree), min_free_bytes=0, import_check=False)
    run = Path(host.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text("[run]\npause = 0.3\n")
    try:
        yield MeasureControl(transport, host), host, Path(host.workdir)
    finally:
        await transport.run(["tmux", "-L", "dflash", "kill-server"])
        await transport.close()


async def test_a_measure_is_followed_to_its_result_and_calibration(
    local: tuple[MeasureControl, HostConfig, Path], tmp_path: Path
) -> None:
    mc, host, wd = local
    req = MeasureRequest(steps=2, rounds=2, strategies=("sorted", "packed"), sets=("a.b=1",))
    started = await mc.start(req)
    assert started.session == measure_session(host.session) == "t-measure"
    d = wd / "measure" / started.measure_id
    assert json.loads((d / "info.json").read_text())["request"]["rounds"] == 2
    assert (d / "config.toml").read_text() == (wd / "run" / "config.toml").read_text()
    lines: list[str] = []
    st = await mc.follow(lines.append, lines.append, poll_s=5)
    assert st.state == "finished" and st.exit_status == 0
    assert lines == [
        "round 1/2 sorted: 1,000 tok/s (run 1 of 4)",
        "round 1/2 packed: 1,000 tok/s (run 2 of 4)",
        "round 2/2 sorted: 1,000 tok/s (run 3 of 4)",
        "round 2/2 packed: 1,000 tok/s (run 4 of 4)",
    ]
    table = await mc.result(st, as_json=False)
    assert table.splitlines()[1:3] == ["sorted 1.00k", "packed 1.00k"]
    assert "\x1b" not in table and "\x07" not in table  # remote text, sanitised
    got = json.loads(await mc.result(st, as_json=True))
    assert list(got["strategies"]) == ["sorted", "packed"] and got["set"] == ["a.b=1"]
    cal = await mc.fetch_calibration(st, tmp_path / "cal.json")
    assert json.loads(cal.read_text())["coef"] == {"fixed": 0.01}
    assert (await mc.state()).measure_id == started.measure_id  # the newest, still


async def test_detached_then_busy_then_result_while_running_then_stopped(
    local: tuple[MeasureControl, HostConfig, Path],
) -> None:
    mc, _, wd = local
    (wd / "run" / "config.toml").write_text("[run]\npause = 2\n")
    started = await mc.start(MeasureRequest(steps=2, rounds=3))
    st = await mc.state(0, 6)  # waits for the first progress line
    assert st.running and st.progress == ["round 1/3 sorted: 1,000 tok/s (run 1 of 6)"]
    with pytest.raises(MeasureBusy) as busy:
        await mc.start(MeasureRequest(steps=2))
    said = str(busy.value)
    assert said.startswith(f"loc: measure {started.measure_id} is already running (since ")
    assert "tmux session 't-measure'" in said and "dflashctl measure loc --result" in said
    assert how_far(st.progress).endswith("(run 1 of 6)")
    stopped = await mc.stop()
    assert stopped is not None and stopped.measure_id == started.measure_id
    after = await mc.state()
    assert after.state == "cancelled" and after.cancelled_at
    err = outcome_error(after, after.progress)
    assert err is not None and "was stopped" in str(err)
    assert await mc.stop() is None
    await mc.start(MeasureRequest(steps=1, strategies=("sorted",)))  # a dead pane is cleared
    assert (await mc.follow(lambda _: None, lambda _: None, poll_s=5)).state == "finished"


async def test_follow_rides_out_a_host_it_cannot_reach_and_misses_no_line(
    local: tuple[MeasureControl, HostConfig, Path],
) -> None:
    """The measure lives in tmux: while its host cannot be asked (here: the transport's PATH
    has no `sh` for 1.5 s, so every round trip fails as a lost host does), follow says so,
    retries, and then goes on from the line it had: none repeated, none skipped."""
    mc, _, wd = local
    (wd / "run" / "config.toml").write_text("[run]\npause = 0.5\n")
    await mc.start(MeasureRequest(steps=2, rounds=3))
    transport = mc.transport
    assert isinstance(transport, LocalTransport)
    path = transport._env["PATH"]
    lines: list[str] = []
    notes: list[str] = []

    def line(text: str) -> None:
        lines.append(text)
        if len(lines) == 1:  # the link "drops" after the first line
            transport._env["PATH"] = "/nonexistent"
            asyncio.get_running_loop().call_later(1.5, transport._env.__setitem__, "PATH", path)

    st = await mc.follow(line, notes.append, poll_s=5, backoff=Backoff(initial=0.2, jitter=0))
    assert st.state == "finished"
    assert lines == [
        f"round {n // 2 + 1}/3 {('sorted', 'packed')[n % 2]}: 1,000 tok/s (run {n + 1} of 6)"
        for n in range(6)
    ]
    assert notes[0].startswith("lost the link (loc: sh: command not found); the measure goes on")
    assert notes[-1] == "reconnected"


async def test_refused_while_training_runs_and_for_what_cannot_run(
    local: tuple[MeasureControl, HostConfig, Path],
) -> None:
    mc, host, wd = local
    ctl = RunControl(mc.transport, host)
    await ctl.start(wait_s=20)
    try:
        with pytest.raises(MeasureBusy) as busy:
            await mc.start(MeasureRequest(steps=2))
        said = str(busy.value)
        assert said.startswith("loc: a training run is running in tmux session 't' (release ")
        assert said.endswith("a measure would share its devices; `dflashctl stop loc` first")
        assert not (wd / "measure").exists()  # nothing was started
    finally:
        await ctl.stop(timeout=budget.left())
    (wd / "run" / "config.toml").unlink()
    with pytest.raises(MeasureError, match=r"^loc: no .*run/config\.toml; deploy with --config"):
        await mc.start(MeasureRequest(steps=2))
    shutil.rmtree(wd / "current" / "trainer" / "measure")
    with pytest.raises(MeasureError, match=r"has no trainer/measure/__main__\.py"):
        await mc.start(MeasureRequest(steps=2))
    (wd / "current").unlink()
    with pytest.raises(MeasureError, match=r"^loc: nothing deployed; run `dflashctl deploy loc`"):
        await mc.start(MeasureRequest(steps=2))


async def test_a_refusal_and_a_lost_measure_are_one_line_each(
    local: tuple[MeasureControl, HostConfig, Path],
) -> None:
    mc, _, wd = local
    await mc.start(MeasureRequest(steps=2, strategies=("sorted", "bogus")))
    st = await mc.follow(lambda _: None, lambda _: None, poll_s=5)
    err = outcome_error(st, st.progress)
    assert isinstance(err, MeasureRefused)
    assert str(err) == "loc: trainer.measure: --strategies: 'bogus' is not a batching strategy"
    (wd / "run" / "config.toml").write_text("[run]\npause = 5\n")
    started = await mc.start(MeasureRequest(steps=2))
    await mc.transport.run(["tmux", "-L", "dflash", "kill-server"])  # a container restart
    st = await mc.state()
    assert st.state == "lost" and st.measure_id == started.measure_id
    assert "ended without a result" in str(outcome_error(st, st.progress))
    # asked by id while a newer measure runs in the session: the session is not the old one's
    await asyncio.sleep(1.1)  # ids are UTC seconds
    newer = await mc.start(MeasureRequest(steps=2))
    assert (await mc.state()).running and (await mc.state()).measure_id == newer.measure_id
    old = await mc.state(measure_id=started.measure_id)
    assert old.state == "lost" and old.measure_id == started.measure_id
    assert (await mc.state(measure_id="20000101T000000Z")).state == "none"
    with pytest.raises(UsageError, match="is not a measure id"):
        await mc.state(measure_id="../run")
    assert await mc.stop() is not None


async def test_start_restart_and_a_groups_start_are_refused_while_a_measure_runs_and_status_shows_it(
    local: tuple[MeasureControl, HostConfig, Path], tmp_path: Path
) -> None:
    """Both would share the devices: refused (one line: the host, the measure's id and since
    when, how to see and stop it) before anything starts; status shows the running measure and
    nothing once it stopped or finished; then the start goes ahead."""
    mc, host, wd = local
    (wd / "run" / "config.toml").write_text("[run]\npause = 2\n")
    started = await mc.start(MeasureRequest(steps=2, rounds=3))
    mid = started.measure_id
    await mc.state(0, 6)  # its first progress line
    ctl = RunControl(mc.transport, host)
    st = await ctl.status()
    assert st.state == "stopped" and st.measure is not None
    when = measure_started(mid)
    assert when is not None
    since = iso_utc(when)
    assert (st.measure.id, st.measure.session, st.measure.since) == (mid, "t-measure", since)
    assert st.measure.progress == "round 1/3 sorted: 1,000 tok/s (run 1 of 6)"
    assert st.measure.age_s is not None and 0 <= st.measure.age_s < 60
    assert f"  measure: {mid} running since {since} (" in format_run_status(st)
    assert json.loads(json.dumps(st.to_json_dict(), default=str))["measure"]["id"] == mid

    def no_run() -> None:
        assert not (wd / "run" / ".release").exists()  # start records it before new-session

    with pytest.raises(MeasureInProgress) as refused:
        await ctl.start(wait_s=5)
    assert str(refused.value) == (
        f"loc: measure {mid} is running there (since {since}, tmux session 't-measure'): a "
        "training run would share its devices; `dflashctl measure loc --result` shows how far "
        "it is, `dflashctl measure loc --stop` ends it"
    )
    assert refused.value.exit_code == ExitCode.FAILED
    no_run()
    current = (wd / "current").readlink()
    with pytest.raises(
        MeasureInProgress, match=r"^loc: measure \S+ is running there .*: a restarted run"
    ):
        await ctl.restart(release=build_release(REPO / "tests" / "ctl" / "standin"))
    assert (wd / "current").readlink() == current  # refused before its deploy
    no_run()
    # a group with this host as node 1 (node 0: a host with nothing deployed): neither starts
    sock = tmp_path / "tmux0"
    sock.mkdir()
    node0 = local_host("n0", tmp_path / "wd0", python=sys.executable, session="t0")
    t0 = LocalTransport(env={"TMUX_TMPDIR": str(sock)})
    try:
        gc = GroupControl(GroupConfig(name="g", nodes=(node0, host)), [t0, mc.transport])
        with pytest.raises(MeasureInProgress) as refused:
            await gc.start(wait_s=5)
        assert str(refused.value).startswith(
            f"group 'g': not starting: loc: measure {mid} is running there (since {since}, "
            "tmux session 't-measure'): the group's run would share its devices; "
        )
        with pytest.raises(MeasureInProgress, match=r"^group 'g': not restarting: loc: measure"):
            await gc.restart(release=build_release(REPO / "tests" / "ctl" / "standin"))
        assert not (tmp_path / "wd0").exists()  # nothing deployed to node 0
    finally:
        await t0.close()
    no_run()
    assert await mc.stop() is not None
    assert (await ctl.status()).measure is None  # stopped: not shown
    (wd / "run" / "config.toml").write_text("[run]\npause = 0.1\n")
    await mc.start(MeasureRequest(steps=1, strategies=("sorted",)))
    assert (await mc.follow(lambda _: None, lambda _: None, poll_s=5)).state == "finished"
    st = await ctl.status()
    assert st.measure is None and "measure" not in format_run_status(st)  # finished: --result's
    res = await ctl.start(wait_s=20)
    try:
        assert res.started
    finally:
        await ctl.stop(timeout=budget.left())


# --- the CLI over real sshd + pct + LXC + tmux, the real trainer.measure ----------------------


def tiny_measure_config(path: Path) -> Path:
    """The tiny config at 1/3 of its rows (its store and target built in the container, under
    run/.cache, on first use, as a training start would)."""
    from trainer.config.overlay import dump_toml, merge

    raw = merge(
        tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text()),
        {"data": {"synthetic": {"rows": 1000}}, "batching": {"pool_size": 400}},
    )
    path.write_text(dump_toml(raw))
    return path


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main(args)
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_measure_over_ssh_follows_detaches_refuses_and_prints_the_table(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_part(
        (REPO / "trainer" / "measure" / "__main__.py").is_file(),
        "the real trainer.measure is not in this checkout",
    )
    cfg = tiny_measure_config(tmp_path / "run.toml")
    inv = P.pinned_inventory(real_parts, tmp_path, run_config=cfg)
    tree = P.frozen_tree(tmp_path / "tree")
    rc, out, err = cli([*inv, "measure", "ct", "--steps", "2"], capsys)
    assert rc == ExitCode.FAILED and "ct: nothing deployed; run `dflashctl deploy ct`" in err
    assert cli([*inv, "deploy", "ct", "--tree", str(tree), "--no-memory-check"], capsys)[0] == 0
    short = ["--steps", "2", "--warmup", "1", "--rounds", "1", "--strategies", "sorted,packed"]

    # a bad --set key: refused here, before anything starts
    rc, out, err = cli([*inv, "measure", "ct", *short, "--set", "batching.nope=1"], capsys)
    assert rc == ExitCode.USAGE and "batching.nope" in err and err.count("\n") == 1, err
    # a strategy the release does not have: trainer.measure's own line, the host named
    rc, out, err = cli(
        [*inv, "measure", "ct", "--steps", "2", "--strategies", "sorted,nope"], capsys
    )
    assert rc == ExitCode.USAGE, err
    assert "dflashctl: ct: trainer.measure: --strategies: 'nope' is not a batching strategy" in err

    # followed to the end: progress on stderr, the JSON on stdout, the calibration fetched
    cal = tmp_path / "cal.json"
    rc, out, err = cli(
        [*inv, "measure", "ct", *short, "--json", "--save-calibration", str(cal)], capsys
    )
    assert rc == 0, err
    result = json.loads(out)
    assert list(result["strategies"]) == ["sorted", "packed"]
    for e in result["strategies"].values():
        assert e["tokens_s"] > 0 and e["samples_s"] > 0
    assert "ct: round 1/1 sorted: " in err and "(run 2 of 2)" in err
    assert set(json.loads(cal.read_text())["coef"]) == set(result["calibration"]["coef"])
    mid = sorted(p.name for p in (clean_workdir / "measure").iterdir())[-1]
    assert (clean_workdir / "measure" / mid / "table.txt").is_file()

    # detached: a second measure is refused, --result says how far, then prints the table
    rc, out, err = cli([*inv, "measure", "ct", *short, "--detach"], capsys)
    assert rc == 0 and "detached; `dflashctl measure ct --result`" in err, err
    rc, out, err = cli([*inv, "measure", "ct", *short], capsys)
    assert rc == ExitCode.FAILED and "is already running (since " in err, err
    assert "tmux session 'dflash-test-measure'" in err and err.count("\n") == 1
    # and the other way round: no training start while it runs; status shows it
    rc, out, err = cli([*inv, "start", "ct"], capsys)
    assert rc == ExitCode.FAILED and err.count("\n") == 1, err
    assert re.match(r"dflashctl: ct: measure \d{8}T\d{6}Z is running there \(since ", err), err
    assert err.rstrip().endswith("`dflashctl measure ct --stop` ends it"), err
    rc, out, err = cli([*inv, "status", "ct"], capsys)
    assert rc == 0 and "  measure: " in out and " in tmux session 'dflash-test-measure': " in out
    rc, out, err = cli([*inv, "status", "ct", "--json"], capsys)
    assert json.loads(out)[0]["measure"]["session"] == "dflash-test-measure", out
    rc, out, err = cli([*inv, "measure", "ct", "--result"], capsys)
    assert rc == ExitCode.FAILED and "is still running (since " in err and not out, err
    while rc != 0:
        assert "is still running" in err, err
        assert budget.left() > 3, "the detached measure did not finish within the test's budget"
        time.sleep(3)
        rc, out, err = cli([*inv, "measure", "ct", "--result"], capsys)
    rows = [ln.split()[0] for ln in out.splitlines()[2:4]]
    assert rows == ["sorted", "packed"], out
    rc, out, err = cli([*inv, "status", "ct", "--json"], capsys)
    assert json.loads(out)[0]["measure"] is None, out  # finished: `--result`'s, not status's
    # an earlier measure by its id: the followed one's JSON
    rc, out, err = cli([*inv, "measure", "ct", "--result", "--id", mid, "--json"], capsys)
    assert rc == 0 and json.loads(out) == result, err
    rc, out, err = cli([*inv, "measure", "ct", "--result", "--id", "20000101T000000Z"], capsys)
    assert rc == ExitCode.FAILED and "ct: no measure 20000101T000000Z in /srv/dflash/measure" in err
    assert len(list((clean_workdir / "measure").iterdir())) == 3  # one refused there, two measured

    # --stop ends a measure and the trainer run under it (seen in the container's own processes)
    def trainers() -> list[str]:
        got = subprocess.run(
            [
                "lxc-attach",
                "-n",
                real_parts.container.name,
                "--",
                "pgrep",
                "-a",
                "-f",
                "m trainer --config",
            ],
            capture_output=True,
            text=True,
            timeout=budget.left(),
            check=False,
        )
        return [ln for ln in got.stdout.splitlines() if " -m trainer --config " in ln]

    # a followed measure goes on when its client is interrupted (Ctrl-C), and says how to get it
    client = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", *inv, "measure", "ct", *short],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )

    def timing() -> list[str]:
        assert client.poll() is None, client.communicate()
        return trainers()

    try:
        budget.until(timing, "the measure to start a timing run", every=0.5)
        client.send_signal(signal.SIGINT)
        _, client_err = client.communicate(timeout=budget.left())
    finally:
        if client.poll() is None:
            client.kill()
            client.wait()
    assert client.returncode == ExitCode.INTERRUPTED, client_err
    assert "goes on in tmux session 'dflash-test-measure'; `dflashctl measure ct --result`" in (
        client_err
    )
    rc, out, err = cli([*inv, "measure", "ct", "--result"], capsys)
    assert rc == ExitCode.FAILED and "is still running" in err, err
    rc, out, err = cli([*inv, "measure", "ct", "--stop"], capsys)
    assert rc == 0 and re.match(r"ct: measure \d{8}T\d{6}Z stopped after \d", out), out
    budget.until(
        lambda: not trainers(),
        "the timing runs to end with their measure",
        every=0.5,
        detail=lambda: str(trainers()),
    )
    rc, out, err = cli([*inv, "measure", "ct", "--result"], capsys)
    assert rc == ExitCode.FAILED and "was stopped (" in err and "before it finished" in err, err
    last = sorted((clean_workdir / "measure").iterdir())[-1]
    budget.until(  # the timing runs' dirs, removed
        lambda: not list((last / "tmp").glob("dflash-measure-*")),
        "the timing runs' temp dirs removed",
        every=0.5,
        detail=lambda: (
            (last / "progress.log").read_text()
            + subprocess.run(
                ["lxc-attach", "-n", real_parts.container.name, "--", "ps", "axjf"],
                capture_output=True,
                text=True,
                check=False,
            ).stdout
        ),
    )
    assert cli([*inv, "measure", "ct", "--stop"], capsys)[1] == "ct: no measure is running\n"


def test_measure_help_says_a_group_measures_on_node_0() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "dflashctl", "measure", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=budget.left(),
        check=False,
    )
    assert proc.returncode == 0 and "on node 0" in " ".join(proc.stdout.split())


def test_a_group_measures_on_node_0_and_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 0 is the one asked (here: a port nobody listens on, so the one line is that it is
    unreachable, exit 3); bad flags are refused before any host is asked."""
    port = P.free_port()
    known = tmp_path / "known_hosts"
    known.write_text("")
    inv_path = tmp_path / "hosts.toml"
    nodes = "".join(
        f'[hosts.n{i}]\naddress = "127.0.0.1"\nport = {port}\nctid = {200 + i}\n'
        f'node_address = "127.0.0.{i + 1}"\nconnect_timeout = 2\n'
        for i in range(2)
    )
    inv_path.write_text(
        f'[defaults]\nknown_hosts = "{known}"\nuse_agent = false\n{nodes}'
        '[groups.g]\nhosts = ["n0", "n1"]\n'
    )
    inv_path.chmod(0o600)
    inv = ["--hosts", str(inv_path)]
    rc, out, err = cli([*inv, "measure", "g", "--result"], capsys)
    assert rc == ExitCode.UNREACHABLE, err
    lines = err.splitlines()
    assert (
        lines[0] == "dflashctl: g: measuring on node 0 (n0); its release and config are the group's"
    )
    assert len(lines) == 2 and "n0" in lines[1] and not out
    rc, out, err = cli([*inv, "measure", "g"], capsys)
    assert rc == ExitCode.USAGE and "--steps N is required to start a measure" in err
    rc, out, err = cli([*inv, "measure", "g", "--steps", "2", "--set", "nokey"], capsys)
    assert rc == ExitCode.USAGE and "--set 'nokey': not KEY=VALUE" in err
    rc, out, err = cli([*inv, "measure", "g", "--steps", "2", "--id", "x"], capsys)
    assert rc == ExitCode.USAGE and "--id ID goes with --result" in err
