"""`dflashctl regen HOST`: trainer.regen in the container under the supervisor, its engine in a
window of its own, shown by status, the TUI and watch.

Pure tests of the request, the status parser, the status line, watch's events and the TUI's
state; then the service over LocalTransport with real tmux, the committed trainer tree and the
real vLLM regeneration engine: a job followed to its end and shown by status; `--serve`
starting the engine itself (health wait, its log, stopped at the end); a stop; a job whose
server stays away past --wait-s, restarted by the supervisor with --resume. The CLI on the
sshd + pct stand-in + LXC harness is in test_regen_lxc.py.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import shutil
import sys
from collections.abc import AsyncIterator
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from dflashctl.alerts.events import EventKind, WatchState, derive, snapshot_from_status
from dflashctl.config.inventory import HostConfig, local_host
from dflashctl.errors import UsageError
from dflashctl.monitor.state import RunState, apply_status, display_state
from dflashctl.releases.deploy import deploy
from dflashctl.releases.release import build_release
from dflashctl.remote import LocalTransport
from dflashctl.remote.run import MARK
from dflashctl.runs.control import RunControl
from dflashctl.runs.follow import Backoff
from dflashctl.runs.regen import RegenBusy, RegenControl, RegenRequest, engine_url
from dflashctl.runs.regen_view import parse_regen_job, regen_line
from dflashctl.tui.widgets.panes import regen_text
from tests.conftest import require_part
from tests.ctl import parts as P
from tests.regen.fault_proxy import FaultProxy, Key
from tests.regen.helpers import read_jsonl, rows_of, write_many
from tests.serving.engine import (
    ENGINE_ARGS,
    ENGINE_ENV,
    REGEN_ENGINE_ARGS,
    SCRIPTED_MODEL,
    serve_cmd,
)
from tests.tui.fixtures import Status
from trainer.events import RegenEvent, format_phase_line, format_regen_line
from trainer.serving.launch import RunningEngine, free_port

JOB = "20261201T170211Z"
LINE = format_regen_line(
    RegenEvent(
        elapsed_min=2, finished=40, total=100, errors=1, length=2, rows_s=0.5, gen_tok_s=812.3,
        prompt_tok_s=2345.6, in_flight=[4, 3], eta_s=120.0, extra={"down": "1", "retries": "3"},
    )
)  # fmt: skip
RUNNING_PANE = "0|||4242"
BUDGET_S = 600.0


# --- pure ------------------------------------------------------------------------------------


def test_the_request_names_its_servers_and_refuses_what_it_sets_itself() -> None:
    assert engine_url(shlex.split("vllm serve /m --port 8123")) == "http://127.0.0.1:8123"
    assert engine_url(["vllm", "serve", "/m", "--port=9000"]) == "http://127.0.0.1:9000"
    assert engine_url(["vllm", "serve", "/m"]) == "http://127.0.0.1:8000"
    req = RegenRequest(inputs=("in.jsonl",), out="o.jsonl", serve="vllm serve /m --port 8123",
                       flags=("--reasoning", "disable"), resume=True)  # fmt: skip
    req.check()
    assert req.regen_argv("py", "/w/regen/x") == [
        "py", "-m", "trainer.regen", "--input", "in.jsonl", "--out", "o.jsonl",
        "--server", "http://127.0.0.1:8123", "--reasoning", "disable", "--run-dir", "/w/regen/x",
        "--resume",
    ]  # fmt: skip
    for bad, said in (
        (RegenRequest(inputs=("i",), out="o"), r"--server URL \(a running engine\) or --serve CMD"),
        (RegenRequest(inputs=("i",), out="o", servers=("u",), flags=("--resume",)), "--resume is"),
        (RegenRequest(inputs=("i",), out="o", serve="vllm serve '"), "--serve"),
        (RegenRequest(inputs=("i",), out="o", serve="v --port x"), "--port 'x' is not a port"),
    ):
        with pytest.raises(UsageError, match=said):
            bad.check()


def report(**parts: str) -> str:
    return "".join(f"{MARK}{name}\n{text}\n" for name, text in parts.items())


def test_the_report_tells_every_state_apart_and_carries_the_progress() -> None:
    from dflashctl.runs.snapshot import split_sections

    sup = json.dumps({"pid": 4242, "state": "running", "restarts": [{"reason": "exit 1"}]})
    info = json.dumps({"out": "o.jsonl", "servers": ["http://127.0.0.1:8000"]})
    log = "\n".join([format_phase_line("regen_server", "http://a down (x); waiting"), LINE])
    base = {"now": "1796485000", "id": JOB, "supervisor": sup, "info": info, "log": log}
    running = parse_regen_job(
        split_sections(report(**base, pane=RUNNING_PANE, engine=RUNNING_PANE))
    )
    assert running is not None and running.state == "running" and running.live
    assert running.engine == "running" and running.restarts == 1 and running.out == "o.jsonl"
    view = running.to_json_dict()
    assert (view["rows_done"], view["rows_total"], view["progress"]) == (40, 100, 0.4)
    assert (view["gen_tok_s"], view["eta_s"], view["errors"], view["length_share"]) == (
        812.3,
        120.0,
        1,
        0.05,
    )
    assert view["in_flight"] == [4, 3] and view["servers_down"] == 1 and view["retries"] == 3
    assert view["server_note"] == "http://a down (x); waiting"
    states = {
        "finished": {"exit": "0"},
        "stopped": {"exit": "130", "cancelled": "2026-12-01T17:09:00Z"},
        "gave-up": {
            "exit": "1",
            "supervisor": json.dumps({"gave_up": True, "detail": "gave up after 3"}),
        },
        "failed": {"exit": "2"},
        "lost": {"pane": ""},
        "restarting": {"pane": RUNNING_PANE, "supervisor": json.dumps({"state": "restarting"})},
    }
    for state, more in states.items():
        job = parse_regen_job(split_sections(report(**{**base, "pane": "1|1||4242", **more})))
        assert job is not None and job.state == state, (state, job)
    assert parse_regen_job(split_sections(report(id=""))) is None
    text = regen_line("h", running)
    for part in ("40/100 rows (40%)", "0.50 rows/s", "812 gen tok/s", "ETA 2m", "errors 1",
                 "length-capped 2 (5.0%)", "in flight [4, 3]", "1 server(s) down", "engine running"):  # fmt: skip
        assert part in text, (part, text)


def test_status_json_the_tui_and_watch_show_a_job_and_its_end() -> None:
    from dflashctl.runs.snapshot import split_sections

    def job(pane: str, exit_text: str = "", detail: str = "") -> Any:
        sup = json.dumps({"gave_up": bool(detail), "detail": detail or None})
        secs = report(now="1796485000", id=JOB, pane=pane, exit=exit_text, supervisor=sup, log=LINE)
        return parse_regen_job(split_sections(secs))

    live, done, gave = (
        job(RUNNING_PANE),
        job("1|0||1", "0"),
        job("1|1||1", "1", "gave up after 3 restarts"),
    )
    # the TUI: "regenerating" while no training run is live, and its line on the host screen
    state = apply_status(RunState("h"), Status(state="stopped", exit_status=0, regen=live))
    assert display_state(state, 0.0) == "regenerating"
    assert display_state(apply_status(state, Status(state="running", regen=live)), 0.0) == "running"
    shown = regen_text(state, 200)
    assert (
        shown is not None
        and "40/100 rows" in shown.plain
        and "dflashctl regen h --status|--stop" in shown.plain
    )
    assert apply_status(state, Status(state="unreachable")).regen == live  # kept while unreachable

    # watch: one event when the job it saw running ends; history at the first poll
    def snap(j: Any, at: float) -> Any:
        return snapshot_from_status(
            {"host": "h", "state": "stopped", "regen": j.to_json_dict()}, at
        )

    w, first = derive(WatchState(), [snap(done, 1.0)], 1.0)
    assert first == []
    w, evs = derive(WatchState(), [snap(live, 1.0)], 1.0)
    w, evs = derive(w, [snap(live, 2.0)], 2.0)
    assert evs == []
    w, evs = derive(w, [snap(done, 3.0)], 3.0)
    assert [e.kind for e in evs] == [EventKind.REGEN_FINISHED] and "40/100 rows" in evs[0].detail
    w, evs = derive(w, [snap(done, 4.0)], 4.0)
    assert evs == []
    w, evs = derive(WatchState(), [snap(live, 1.0)], 1.0)
    w, evs = derive(w, [snap(gave, 2.0)], 2.0)
    assert [e.kind for e in evs] == [EventKind.REGEN_FAILED] and "gave up after 3 restarts" in evs[
        0
    ].detail


# --- the service, locally: real tmux, the committed trainer, the real engine -----------------


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[tuple[RegenControl, HostConfig, Path]]:
    require_part(shutil.which("tmux") is not None, "tmux not installed")
    sock = tmp_path / "tmux"
    sock.mkdir()
    transport = LocalTransport(env={"TMUX_TMPDIR": str(sock), "OMP_NUM_THREADS": "1"})
    host = local_host("loc", tmp_path / "wd", python=sys.executable, session="t")
    host = host.model_copy(update={"restart_backoff_s": 1.0})
    tree = P.frozen_tree(tmp_path / "tree")
    await deploy(transport, host, release=build_release(tree), min_free_bytes=0, import_check=False)
    try:
        yield RegenControl(transport, host), host, Path(host.workdir)
    finally:
        await transport.run(["tmux", "-L", "dflash", "kill-server"])
        await transport.close()


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_a_job_runs_supervised_to_its_end_and_status_shows_it(
    local: tuple[RegenControl, HostConfig, Path], regen_server: RunningEngine
) -> None:
    rc, host, wd = local
    source = write_many(wd / "in.jsonl", 6)
    # the link drops after the first line (the transport's PATH has no `sh` for 1.5 s, so every
    # round trip fails as a lost host does): follow says so, retries, and goes on from the line
    # it had, none repeated, none skipped (the job lives in tmux). The proxy holds the job's
    # requests until the link is back, so the job cannot end before the drop.
    with FaultProxy(regen_server.url, lambda key, attempt: "pass") as gate:
        gate.hold()
        req = RegenRequest(
            inputs=(str(source),), out="out.jsonl", servers=(gate.url,),
            flags=("--reasoning", "disable", "--max-tokens", "64", "--status-interval-s", "1"),
        )  # fmt: skip
        started = await rc.start(req)
        assert started.argv[1:4] == ["-m", "trainer.supervise", "--restart=on-failure"]
        assert "--child" in started.argv and started.engine is None
        with pytest.raises(RegenBusy, match=f"regeneration job {started.job_id} is running"):
            await rc.start(req)
        transport = rc.transport
        assert isinstance(transport, LocalTransport)
        path = transport._env["PATH"]
        lines: list[str] = []
        notes: list[str] = []

        def back() -> None:
            transport._env["PATH"] = path
            gate.release()

        def line(text: str) -> None:
            lines.append(text)
            if len(lines) == 1:
                transport._env["PATH"] = "/nonexistent"
                asyncio.get_running_loop().call_later(1.5, back)

        job = await rc.follow(
            line, notes.append, job_id=started.job_id, poll_s=2.0, backoff=Backoff(0.2, jitter=0)
        )
    assert job.state == "finished" and job.exit_status == 0, (job, lines)
    assert notes[0].startswith("lost the link (loc: sh: command not found); the regeneration job")
    assert notes[-1] == "reconnected", notes
    log = (wd / "regen" / started.job_id / "status.log").read_text()
    assert lines == [ln for ln in log.splitlines() if ln.strip()]
    assert any(ln.startswith("Regen: ") for ln in lines) and any(
        ln.startswith("Regen finished: ") for ln in lines
    )
    assert len(rows_of(wd / "out.jsonl")[1]) == 6
    status = await RunControl(rc.transport, host).status()
    view = status.to_json_dict()["regen"]
    assert view["state"] == "finished" and (view["rows_done"], view["rows_total"]) == (6, 6)
    assert view["gen_tok_s"] > 0 and view["out"] == "out.jsonl"
    assert (wd / "regen" / started.job_id / "supervisor.json").is_file()


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_serve_starts_the_engine_waits_for_it_and_stops_it(
    local: tuple[RegenControl, HostConfig, Path], vllm_python: Path, scripted_target_dir: Path
) -> None:
    rc, _, wd = local
    source = write_many(wd / "in.jsonl", 3)
    port = free_port()
    serve = [*serve_cmd(vllm_python), "--model", str(scripted_target_dir), "--host", "127.0.0.1",
             "--port", str(port), "--dtype", "float32", *ENGINE_ARGS, *REGEN_ENGINE_ARGS]  # fmt: skip
    env = " ".join(f"{k}={v}" for k, v in ENGINE_ENV.items())
    req = RegenRequest(
        inputs=(str(source),), out="out.jsonl", serve=f"env {env} {shlex.join(serve)}",
        flags=("--model", SCRIPTED_MODEL, "--max-tokens", "64", "--status-interval-s", "1"),
    )  # fmt: skip
    started = await rc.start(req)
    assert started.engine is not None and started.engine[-len(serve) :] == serve
    job = await rc.follow(lambda line: None, print, job_id=started.job_id, poll_s=5.0)
    d = wd / "regen" / started.job_id
    assert job.state == "finished", (job, (d / "health.log").read_text())
    assert f"http://127.0.0.1:{port} is up after" in (d / "health.log").read_text()
    assert (d / "engine.log").stat().st_size > 0
    assert job.engine is not None and job.engine.startswith("exited"), job.engine
    assert not P.node_processes(f"--port {port} ")  # the engine and its workers are gone
    assert len(rows_of(wd / "out.jsonl")[1]) == 3


@pytest.mark.slow
@pytest.mark.timeout(1800)
async def test_a_stop_ends_the_job_and_a_server_away_past_wait_s_is_a_restart_with_resume(
    local: tuple[RegenControl, HostConfig, Path], regen_server: RunningEngine
) -> None:
    rc, _, wd = local
    source = write_many(wd / "in.jsonl", 12)
    base = ("--reasoning", "disable", "--max-tokens", "64", "--status-interval-s", "1",
            "--concurrency", "1", "--model", SCRIPTED_MODEL)  # fmt: skip
    with FaultProxy(regen_server.url, lambda key, attempt: "pass", delay_s=1.0) as slow:
        req = RegenRequest(inputs=(str(source),), out="a.jsonl", servers=(slow.url,), flags=base)
        started = await rc.start(req)
        deadline = asyncio.get_running_loop().time() + BUDGET_S
        while len(read_jsonl(wd / "a.jsonl")) < 3:  # the manifest and 2 rows
            assert asyncio.get_running_loop().time() < deadline, "no 2 rows within the budget"
            await asyncio.sleep(0.5)
        stopped = await rc.stop()
    assert stopped is not None and stopped.state == "stopped" and stopped.exit_status == 130
    assert 2 <= len(rows_of(wd / "a.jsonl")[1]) < 12

    # the server goes away for longer than --wait-s: the job exits 1, the supervisor restarts
    # it with --resume, and it ends every row once
    requests = count(1)

    def plan(key: Key, attempt: int) -> str:
        return "restart" if next(requests) == 4 else "pass"

    with FaultProxy(regen_server.url, plan, restart_s=8.0) as flaky:
        req = RegenRequest(
            inputs=(str(source),),
            out="b.jsonl",
            servers=(flaky.url,),
            flags=(*base, "--wait-s", "2"),
        )
        started = await rc.start(req)
        job = await rc.follow(lambda line: None, print, job_id=started.job_id, poll_s=2.0)
    assert job.state == "finished", job
    assert job.restarts >= 1
    sup = json.loads((wd / "regen" / started.job_id / "supervisor.json").read_text())
    assert any(r["reason"] == "exit 1" for r in sup["restarts"]), sup["restarts"]
    log = (wd / "regen" / started.job_id / "status.log").read_text()
    assert "ERROR: no server answered for 2 s" in log and "Restarting trainer: exit 1" in log
    resumed = [ln for ln in log.splitlines() if ln.startswith("Regen starting: ")][-1]
    assert "ended before" in resumed and "(0 ended before)" not in resumed, resumed
    rows = rows_of(wd / "b.jsonl")[1]
    assert len(rows) == len({r["id"] for r in rows}) == 12
