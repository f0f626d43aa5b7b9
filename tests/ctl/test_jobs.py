"""Detached jobs (`dflashctl eval`, `dflashctl gate`): the pure builders and parsers, then the
service over LocalTransport with real tmux and the real `python -m trainer.gate` on the tiny
config (the gate is the cheapest real job: ~15 s here): followed to its verdict, cached per
release and config, refused while training, a measure or another job runs, stopped, lost.

The CLI over the real sshd + pct shim + LXC container is tests/ctl/test_jobs_parts.py (gate and
start with `gate = "before-start"`) and tests/serving/test_eval_ctl.py (eval against vLLM).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import tomllib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflashctl.cli.status_text import format_run_status
from dflashctl.config.inventory import HostConfig, local_host
from dflashctl.errors import UsageError
from dflashctl.jobs.control import JobControl, output_tail
from dflashctl.jobs.evals import EvalPlan, EvalRequest, eval_argv, format_served, target_of
from dflashctl.jobs.gate import GateJob, GateRequest, gate_argv, outcome_of
from dflashctl.jobs.state import JobBusy, JobRefused, error_line, outcome_error, parse_job_status
from dflashctl.releases.deploy import deploy
from dflashctl.releases.release import build_release
from dflashctl.remote import LocalTransport
from dflashctl.remote.jobs import EVAL, GATE, chain, status_argv
from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.run import MARK
from dflashctl.runs.control import RunControl
from dflashctl.runs.detached import DetachedRecord
from dflashctl.runs.measure import (
    MeasureBusy,
    MeasureControl,
    MeasureRequest,
    parse_measure_status,
)
from dflashctl.runs.service import JobInProgress
from tests import budget
from tests.conftest import require_part
from tests.ctl import parts as P
from trainer.config.overlay import dump_toml, merge
from trainer.events.served import parse_served_summary, served_summary

REPO = Path(__file__).resolve().parents[2]
JID = "20261201T170211Z"

# --- pure ------------------------------------------------------------------------------------


def sections(**parts: str) -> str:
    return "".join(f"{MARK}{k}\n{v}\n" for k, v in parts.items())


def test_the_job_status_parser_tells_every_state_apart() -> None:
    live, dead = "0|||412", "1|0||412"
    base = {"now": "1796144000", "current": "releases/abc123", "runnable": "yes"}

    def st(**kw: str) -> str:
        return parse_job_status("h", GATE, "/srv/d", sections(**{**base, **kw})).state

    assert st(id="") == "none"
    assert st(id=JID, pane=live) == "running"
    assert st(id=JID, pane=dead, exit="0") == "finished"
    assert st(id=JID, pane=dead, exit="1") == "failed"
    assert st(id=JID, pane="") == "lost"
    assert st(id=JID, pane="", cancelled="2026-12-01T17:05:00Z") == "cancelled"
    assert st(id="../../etc") == "none"  # only ids of the job format are read
    got = parse_job_status(
        "h",
        EVAL,
        "/srv/d",
        sections(**base, id=JID, pane=live, key="abc123 " + "f" * 64, output="turn 1\x1b[31m"),
    )
    assert got.release == "abc123" and got.runnable and got.key == "abc123 " + "f" * 64
    assert got.output == ["turn 1"]  # remote text made safe where it enters
    assert got.directory == f"/srv/d/eval/{JID}" and got.name == f"eval {JID}"
    assert got.since().startswith("since 2026-12-01 17:02:11 UTC, ")
    assert parse_job_status("h", GATE, "/d", f"{MARK}noworkdir\n").state == "none"


def test_a_job_and_a_measure_read_one_status_alike() -> None:
    """eval/gate and measure share one record and one status parser (dflashctl.runs.detached):
    the same status text is the same state, times and exit status for either."""
    live, dead = "0|||412", "1|0||412"
    base = {"now": "1796144000", "current": "releases/abc123"}
    for extra in (
        {"id": ""},
        {"id": JID, "pane": live},
        {"id": JID, "pane": dead, "exit": "0"},
        {"id": JID, "pane": dead, "exit": "3"},
        {"id": JID, "pane": ""},
        {"id": JID, "pane": "", "cancelled": "2026-12-01T17:05:00Z"},
    ):
        text = sections(**{**base, **extra})
        job, measure = (
            parse_job_status("h", GATE, "/d", text),
            parse_measure_status("h", "/d", text),
        )
        assert isinstance(job, DetachedRecord) and isinstance(measure, DetachedRecord)
        assert (job.record_id, job.state, job.exit_status, job.cancelled_at, job.release) == (
            measure.record_id,
            measure.state,
            measure.exit_status,
            measure.cancelled_at,
            measure.release,
        ), extra
        assert (job.running, job.age(), job.since()) == (
            measure.running,
            measure.age(),
            measure.since(),
        )


def test_outcomes_pass_the_modules_own_line_through_naming_the_host() -> None:
    refused = parse_job_status("h", GATE, "/d", sections(id=JID, exit="2"))
    err = outcome_error(refused, ["error: --config run/config.toml: no such file"])
    assert isinstance(err, JobRefused)
    assert str(err) == "h: trainer.gate: --config run/config.toml: no such file"
    failed = parse_job_status("h", EVAL, "/d", sections(id=JID, exit="1"))
    said = ["prompt a:1 ...", "error: engine at http://127.0.0.1:1 is not answering"]
    assert str(outcome_error(failed, said)) == (
        f"h: eval {JID} failed: engine at http://127.0.0.1:1 is not answering"
    )
    assert error_line(["gate setup: ok", "gate FAILED at stage masks: x"], 1) == (
        "gate FAILED at stage masks: x"
    )
    assert error_line([], 137) == "exit status 137"
    assert output_tail(["a", "", "b", "c", "d"]) == "b; c; d"


def test_a_failed_gates_stage_is_its_verdict_lines_or_the_first_stage_not_ok() -> None:
    st = parse_job_status("h", GATE, "/d", sections(id=JID, exit="1"))
    from dataclasses import replace

    st = replace(st, output=["gate setup: ok (...)", "gate FAILED at stage export: x.json: bad"])
    result = {"stages": [{"stage": "setup", "ok": True}, {"stage": "export", "ok": False}]}
    got = outcome_of(st, result)
    assert (got.passed, got.stage, got.line) == (
        False,
        "export",
        "gate FAILED at stage export: x.json: bad",
    )
    assert outcome_of(replace(st, output=[]), result).stage == "export"


def test_eval_requests_are_checked_before_anything_connects() -> None:
    ok = EvalRequest(remote_prompts=("/p.jsonl",), server="http://127.0.0.1:8000")
    ok.check()
    for bad, said in (
        (EvalRequest(server="http://x"), "--prompts FILE (local) or --remote-prompts PATH"),
        (EvalRequest(remote_prompts=("/p",)), "exactly one of --server URL or --serve-cmd"),
        (
            EvalRequest(remote_prompts=("/p",), server="http://x", serve_cmd="vllm serve"),
            "exactly one of",
        ),
        (EvalRequest(remote_prompts=("/p",), server="x:1"), "not an http(s) URL"),
        (
            EvalRequest(remote_prompts=("/p",), server="http://x", engine="sglang"),
            "eval: --engine sglang: SGLang is not supported: its DFlash worker needs CUDA",
        ),
        (
            EvalRequest(remote_prompts=("/p",), server="http://x", serve_args=("--a",)),
            "--serve-arg goes with --serve-cmd",
        ),
        (EvalRequest(remote_prompts=("/p",), serve_cmd="vllm 'serve"), "--serve-cmd"),
        (
            EvalRequest(remote_prompts=("/p",), server="http://x", drafter="/e", checkpoint="best"),
            "--drafter DIR and --checkpoint C exclude each other",
        ),
        (EvalRequest(remote_prompts=("rel",), server="http://x"), "--remote-prompts 'rel'"),
        (
            EvalRequest(remote_prompts=("/p",), server="http://x", checkpoint="last"),
            "--checkpoint 'last': latest, best, a step",
        ),
        (
            EvalRequest(remote_prompts=("/p",), server="http://x", tolerance=1.5),
            "--tolerance 1.5",
        ),
        (
            EvalRequest(remote_prompts=("/p",), server="http://x", template_kwargs="[1]"),
            "--template-kwargs: not a JSON object",
        ),
        (
            EvalRequest(prompts=(Path("a/q.jsonl"), Path("b/q.jsonl")), server="http://x"),
            "two files named q.jsonl",
        ),
    ):
        with pytest.raises(UsageError) as got:
            bad.check()
        assert said in str(got.value) and "\n" not in str(got.value), got.value
    for bad_gate, said in (
        (GateRequest(samples=0), "--samples 0: must be >= 1"),
        (GateRequest(server="http://x"), "need --engine vllm"),
        (GateRequest(engine="vllm"), "exactly one of --server URL or --serve-cmd"),
    ):
        with pytest.raises(UsageError, match=said):
            bad_gate.check()


def test_the_eval_argv_exports_a_checkpoint_first_and_writes_into_the_job() -> None:
    req = EvalRequest(
        remote_prompts=("/data/gsm8k.jsonl",),
        serve_cmd="/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server",
        serve_args=("--enforce-eager", "--max-model-len=8192"),
        max_new_tokens=64,
    )
    lay = RemoteLayout("/srv/d")
    d = f"/srv/d/eval/{JID}"
    plan = EvalPlan("/srv/d/run/.cache/t", f"{d}/export", "/srv/d/run/checkpoints/x.pt", 4)
    plan = EvalPlan(plan.target, plan.drafter, plan.checkpoint, plan.step, ["/data/gsm8k.jsonl"])
    argv = eval_argv("/py", lay, JID, req, plan)
    assert argv[:2] == ["sh", "-c"] and argv[3] == "dflash-chain"
    assert argv[2] == (
        "/py -m trainer.export --checkpoint /srv/d/run/checkpoints/x.pt --out "
        f"{d}/export --target /srv/d/run/.cache/t" + ' && exec "$@"'
    )
    assert argv[4:] == [
        "/py", "-m", "trainer.eval", "--target", "/srv/d/run/.cache/t", "--drafter",
        f"{d}/export", "--prompts", "/data/gsm8k.jsonl", "--engine", "vllm", "--serve-cmd",
        "/opt/vllm/bin/python -m vllm.entrypoints.openai.api_server", "--serve-log",
        f"{d}/engine.log", "--serve-arg=--enforce-eager", "--serve-arg=--max-model-len=8192",
        "--max-new-tokens", "64", "--json", f"{d}/result.json", "--summary-json",
        f"{d}/summary.json",
    ]  # fmt: skip
    served = EvalRequest(remote_prompts=("/p",), server="http://127.0.0.1:8000")
    plain = eval_argv("/py", lay, JID, served, EvalPlan("/t", "/e", prompts=["/p"]))
    assert plain[:3] == ["/py", "-m", "trainer.eval"] and "--server" in plain
    gate = gate_argv("/py", lay, JID, GateRequest(samples=2))
    assert gate == [
        "/py", "-m", "trainer.gate", "--config", "/srv/d/run/config.toml", "--samples", "2",
        "--out", f"/srv/d/gate/{JID}/out", "--json", f"/srv/d/gate/{JID}/result.json",
    ]  # fmt: skip


def test_chain_quotes_the_first_command_once_and_runs_the_second_only_after_it() -> None:
    """The two-step argv through a real shell: arguments with blanks and quotes arrive whole,
    and a failed first step stops the second."""
    got = subprocess.run(
        chain(["printf", "%s|", "a b", "c'd"], ["printf", "%s|", "x y", "$HOME"]),
        capture_output=True,
        text=True,
        check=False,
    )
    assert got.returncode == 0 and got.stdout == "a b|c'd|x y|$HOME|"
    failed = subprocess.run(chain(["false"], ["echo", "ran"]), capture_output=True, text=True)
    assert failed.returncode == 1 and failed.stdout == ""


def test_the_target_comes_from_the_run_config_as_the_trainer_resolves_it() -> None:
    rel = '[model]\ntarget_dir = ".cache/tiny-qwen3"\n'
    assert target_of(rel, "/srv/d/run", "x") == "/srv/d/run/.cache/tiny-qwen3"
    assert target_of('[model]\ntarget_dir = "/m/q"\n', "/srv/d/run", "x") == "/m/q"
    assert target_of('[model]\ntarget_dir = "../m"\n', "/srv/d/run", "x") == "/srv/d/m"
    with pytest.raises(
        Exception, match=r"^ct: run/config.toml: no model.target_dir; pass --target"
    ):
        target_of("[data]\n", "/srv/d/run", "ct: run/config.toml")


def test_the_status_argv_names_the_kinds_root_session_and_source() -> None:
    argv = status_argv("/w", GATE, "s", 3, 2.0, JID)
    assert argv[3:] == ["dflash-gate-status", "/w", "s-gate", "4", "4", "gate",
                        "trainer/gate/__main__.py", JID]  # fmt: skip
    with pytest.raises(UsageError, match="is not a job id"):
        status_argv("/w", EVAL, "s", job_id="../run")


def test_the_served_summary_is_built_from_trainer_evals_document_and_read_back() -> None:
    side = {
        "tau": 3.5,
        "tau_pooled": 3.4,
        "verify_steps": 12,
        "acceptance_per_position": [1.0, 0.75, 0.5],
    }
    payload = {
        "summary": {"protocol": "exact", "prompts": 2, "block_size": 4, "matches": 2, "tau": 3.5,
                    "tau_pooled": 3.4, "verify_steps": 12},
        "engine": {"name": "vllm", "version": "0.32.0"},
        "served": {"summary": {"own": side, "served": {**side, "tau": 3.0}, "agree": False,
                               "differences": ["position 2 accepted 8 served vs 9 own"]}},
    }  # fmt: skip
    summary = served_summary(payload, partial=True)
    back, why = parse_served_summary(summary.model_dump_json())
    assert why is None and back == summary
    assert back.own.acceptance_per_position == [1.0, 0.75, 0.5]
    assert back.served is not None and back.ratio == pytest.approx(3.0 / 3.5)
    lines = format_served(back)
    assert lines[0].startswith("own loop   tau 3.500 over 2 turn(s), protocol exact, block 4")
    assert lines[1] == "vllm 0.32.0 tau 3.000, per position [1.00 0.75 0.50]"
    assert lines[2] == "served/own tau 0.857: DIFFER: position 2 accepted 8 served vs 9 own"
    assert lines[3].startswith("partial:")
    assert parse_served_summary("") == (None, None)
    got, why = parse_served_summary('{"protocol": "exact", "turns": 1, "block_size": 4}')
    assert got is None and why == "own: Field required"


# --- the service over LocalTransport, real tmux, the real trainer.gate -----------------------


def tiny_gate_config(rows: int = 64) -> str:
    """configs/tiny-cpu.toml with a small store; its relative paths are resolved against the
    deployed run/ (the gate builds the store and target there, as a training start would)."""
    raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    return dump_toml(merge(raw, {"data": {"synthetic": {"rows": rows}}}))


@dataclass
class Local:
    transport: LocalTransport
    host: HostConfig
    workdir: Path


@pytest.fixture
async def local(tmp_path: Path) -> AsyncIterator[Local]:
    """A local "container" with the committed trainer deployed and the tiny config as its run
    config; its own tmux server; one torch thread per process."""
    require_part(shutil.which("tmux") is not None, "tmux not installed")
    sock = tmp_path / "tmux"
    sock.mkdir()
    transport = LocalTransport(env={"TMUX_TMPDIR": str(sock)})
    host = local_host("loc", tmp_path / "wd", python=sys.executable, session="t")
    host = host.model_copy(update={"env": {**host.env, "OMP_NUM_THREADS": "1"}})
    tree = P.frozen_tree(tmp_path / "tree")
    await deploy(transport, host, release=build_release(tree), min_free_bytes=0, import_check=False)
    run = Path(host.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text(tiny_gate_config())
    try:
        yield Local(transport, host, Path(host.workdir))
    finally:
        await transport.run(["tmux", "-L", "dflash", "kill-server"])
        await transport.close()


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_a_gate_is_followed_to_its_verdict_and_cached_per_release_and_config(
    local: Local,
) -> None:
    gate = GateJob(local.transport, local.host)
    key, passed = await gate.cached_pass()
    assert passed is None and key.split()[0] == (local.workdir / "current").readlink().name
    started = await gate.start(GateRequest())
    assert started.session == "t-gate" and started.directory.endswith(started.job_id)
    lines: list[str] = []
    st = await gate.jobs.follow(lines.append, lines.append, poll_s=5)
    assert st.state == "finished" and st.exit_status == 0, lines
    stages = [ln.split(":")[0] for ln in lines if ln.startswith("gate ") and ": ok (" in ln]
    assert stages == [f"gate {s}" for s in ("setup", "capture", "masks", "train", "decode",
                                             "export")]  # fmt: skip
    outcome = await gate.outcome(st)
    assert outcome.passed and outcome.line.startswith("gate PASSED in ")
    assert outcome.result["own_tau"] >= outcome.result["threshold"]
    assert (Path(st.directory) / "out" / "export" / "config.json").is_file()
    # the cache: this release and config passed; a changed config has another key
    key2, passed = await gate.cached_pass()
    assert (key2, passed) == (key, started.job_id) and st.key == key
    cfg = Path(local.host.run_dir) / "config.toml"
    cfg.write_text(cfg.read_text().replace("rows = 64", "rows = 65"))
    key3, passed = await gate.cached_pass()
    assert passed is None and key3.split()[0] == key.split()[0] and key3 != key


LONG_GATE = GateRequest(samples=64, max_steps=100_000)
"""A gate that runs for minutes whatever the machine: 64 samples are more than the tiny
drafter memorises, so it trains until --max-steps (deterministic on CPU, not a race)."""


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_jobs_refuse_each_other_and_training_and_stop_on_ctrl_c(local: Local) -> None:
    """A second gate or an eval while a gate runs, and a gate while the run trains, are refused
    with one line; --stop interrupts the gate (state cancelled, no exit status left running);
    a killed tmux server leaves it lost."""
    gate = GateJob(local.transport, local.host)
    started = await gate.start(LONG_GATE)
    st = await gate.jobs.state(0, 20, started.job_id)  # its first output line
    assert st.running
    with pytest.raises(JobBusy) as busy:
        await gate.start(GateRequest())
    said = str(busy.value)
    assert said.startswith(f"loc: gate {started.job_id} is already running (since ")
    assert "tmux session 't-gate'" in said and "`dflashctl gate loc --result`" in said
    evals = JobControl(local.transport, local.host, EVAL)
    with pytest.raises(JobBusy, match=rf"^loc: gate {started.job_id} is already running"):
        await evals.check_free()
    # the other way round: no training start or restart, no measure, while it runs; status
    # shows it (read in its one round trip)
    ctl = RunControl(local.transport, local.host)
    status = await ctl.status()
    assert status.job is not None and (status.job.kind, status.job.id) == ("gate", started.job_id)
    assert f"  gate: {started.job_id} running since " in format_run_status(status)
    with pytest.raises(JobInProgress) as refused:
        await ctl.start(wait_s=5)
    assert str(refused.value) == (
        f"loc: gate {started.job_id} is running there (since {status.job.since}, tmux session "
        "'t-gate'): a training run would share its devices; `dflashctl gate loc --result` shows "
        "how far it is, `dflashctl gate loc --stop` ends it"
    )
    assert not (local.workdir / "run" / ".release").exists()  # nothing started
    with pytest.raises(JobInProgress, match=r": a restarted run would share its devices"):
        await ctl.restart(release=build_release(local.workdir / "current"))
    with pytest.raises(MeasureBusy, match=rf"^loc: gate {started.job_id} is running there"):
        await MeasureControl(local.transport, local.host).start(MeasureRequest(steps=1))
    stopped = await gate.jobs.stop(grace_s=60)
    assert stopped is not None and stopped.job_id == started.job_id
    assert (await ctl.status()).job is None
    after = await gate.jobs.state()
    assert after.state == "cancelled" and after.cancelled_at, after
    assert "was stopped" in str(outcome_error(after, after.output))
    assert await gate.jobs.stop() is None
    # while the run trains: refused before anything starts
    await ctl.start(wait_s=120)
    try:
        with pytest.raises(JobBusy) as busy:
            await gate.start(GateRequest())
        assert str(busy.value).startswith("loc: a training run is running in tmux session 't'")
        assert str(busy.value).endswith("gate would share its devices; `dflashctl stop loc` first")
    finally:
        await ctl.stop(timeout=budget.left())
    # a container restart (here: the tmux server killed) leaves a running gate lost
    again = await gate.start(LONG_GATE)
    await gate.jobs.state(0, 20, again.job_id)
    await local.transport.run(["tmux", "-L", "dflash", "kill-server"])
    lost = await gate.jobs.state()
    assert lost.state == "lost" and lost.job_id == again.job_id
    assert "ended without a result" in str(outcome_error(lost, lost.output))
    old = await gate.jobs.state(job_id=started.job_id)  # an older job by its id
    assert old.state == "cancelled" and old.job_id == started.job_id
    await asyncio.sleep(0)


def test_eval_info_and_summary_show_what_was_evaluated(tmp_path: Path) -> None:
    """`info.json` records the resolved request (the status round trip reads it beside the
    summary): written as the job writes it, read back by `parse_served`."""
    from dflashctl.runs.snapshot import parse_served

    summary = served_summary(
        {
            "summary": {"protocol": "exact", "prompts": 1, "block_size": 4, "matches": 1,
                        "tau": 4.0, "tau_pooled": 4.0, "verify_steps": 12},
            "engine": {"name": "vllm", "version": "0.32.0"},
            "served": {"summary": {"own": {"tau": 4.0, "acceptance_per_position": [1, 1, 1]},
                                   "served": {"tau": 4.0, "acceptance_per_position": [1, 1, 1]},
                                   "agree": True, "differences": []}},
        },
        partial=False,
    )  # fmt: skip
    info = {"checkpoint": "/srv/d/run/checkpoints/step-00000400.pt", "step": 400}
    got = parse_served(
        {
            "served_id": JID,
            "served": summary.model_dump_json(),
            "served_info": json.dumps(info),
            "served_now": str(1796144000 + 3600),
        }
    )
    assert got is not None and got.step == 400 and got.summary.agree
    assert got.since == "2026-12-01 17:02:11 UTC"
    assert parse_served({"served_id": JID, "served": "{not json"}) is None
    assert parse_served({"served_id": "x", "served": summary.model_dump_json()}) is None


def test_the_gate_setting_is_per_host_or_from_defaults_and_checked(tmp_path: Path) -> None:
    from dflashctl.config.inventory import InventoryError, parse_inventory

    text = (
        '[defaults]\ngate = "before-start"\n'
        '[hosts.a]\naddress = "n1"\nctid = 200\n'
        '[hosts.b]\naddress = "n2"\nctid = 201\ngate = "off"\n'
    )
    inv = parse_inventory(text, tmp_path / "hosts.toml")
    assert (inv.get("a").gate, inv.get("b").gate) == ("before-start", "off")
    assert (
        parse_inventory('[hosts.c]\naddress = "n"\nctid = 202\n', tmp_path / "h").get("c").gate
        == "off"
    )
    with pytest.raises(InventoryError) as bad:
        parse_inventory('[hosts.c]\naddress = "n"\nctid = 202\ngate = "always"\n', tmp_path / "h")
    assert str(bad.value).startswith(f"{tmp_path / 'h'}: host 'c': gate: ") and "\n" not in str(
        bad.value
    )


def test_a_group_gates_evaluates_and_compares_on_node_0(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 0 is the one asked (here: a port nobody listens on, so the one line is that it is
    unreachable, exit 3); bad flags are refused before any host is asked."""
    from dflashctl.cli.main import main as cli_main
    from dflashctl.errors import ExitCode

    port = P.free_port()
    known = tmp_path / "known_hosts"
    known.write_text("")
    nodes = "".join(
        f'[hosts.n{i}]\naddress = "127.0.0.1"\nport = {port}\nctid = {200 + i}\n'
        f'node_address = "127.0.0.{i + 1}"\nconnect_timeout = 2\n'
        for i in range(2)
    )
    inv_path = tmp_path / "hosts.toml"
    inv_path.write_text(
        f'[defaults]\nknown_hosts = "{known}"\nuse_agent = false\n{nodes}'
        '[groups.g]\nhosts = ["n0", "n1"]\n'
    )
    inv_path.chmod(0o600)
    inv = ["--hosts", str(inv_path)]

    def run(*args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        rc = cli_main([*inv, *args])
        got = capsys.readouterr()
        return rc, got.out, got.err

    rc, out, err = run("gate", "g", "--result")
    assert rc == ExitCode.UNREACHABLE and not out, err
    lines = err.splitlines()
    assert lines[0] == "dflashctl: g: gating on node 0 (n0); its release and config are the group's"
    assert len(lines) == 2 and "n0" in lines[1]
    rc, out, err = run("eval", "g", "--remote-prompts", "/p.jsonl", "--server", "http://x:1")
    assert rc == ExitCode.UNREACHABLE and err.startswith("dflashctl: g: evaluating on node 0 (n0)")
    rc, out, err = run("eval", "g", "--server", "http://x:1")
    assert rc == ExitCode.USAGE and "--prompts FILE (local) or --remote-prompts PATH" in err
    rc, out, err = run("gate", "g", "--samples", "0")
    assert rc == ExitCode.USAGE and "gate: --samples 0: must be >= 1" in err
    rc, out, err = run("gate", "g", "--id", "20261201T170211Z")
    assert rc == ExitCode.USAGE and "--id ID goes with --result" in err
    rc, out, err = run("compare", "g", "g~1")
    assert rc == ExitCode.UNREACHABLE and "n0" in err and err.count("\n") == 1, err
