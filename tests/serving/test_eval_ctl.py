"""`dflashctl eval HOST` over the real parts against the session's real vLLM (CPU build).

The container is an LXC container behind the loopback sshd and the pct shim, in the host's
network namespace (`lxc_container(host_network=True)`), so trainer.eval inside it reaches the
session's engine at 127.0.0.1 as a container reaches an engine on its own node; the served
target and the gate's export are mounted at their own paths. The eval runs the committed
trainer as a release deployed by `dflashctl deploy`, followed to its summary; status and the
TUI's eval pane show its served tau; a drafter the engine does not serve as it was trained
(layer ids one off in the project's loop) makes the loops differ, exit 1 with the summary; an
engine that is not there is trainer.eval's one line, the host and the job named.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.inventory import load_inventory
from dflashctl.errors import ExitCode
from dflashctl.monitor.state import RunState, apply_status
from dflashctl.remote.connect import make_transport
from dflashctl.runs.control import RunControl
from dflashctl.tui.widgets.panes import eval_text
from tests.conftest import require_part
from tests.ctl import parts as P
from tests.serving.broken_exports import layer_ids_shifted
from tests.serving.engine import GATE_RESPONSE_TOKENS, GateRun
from trainer.serving.launch import RunningEngine, free_port

pytestmark = pytest.mark.timeout(1800)  # the session's engine may start within this module
GSM8K = Path(__file__).resolve().parents[1] / "fixtures" / "eval-prompts" / "gsm8k_test.jsonl"


@pytest.fixture(scope="module")
def shared_dir() -> Iterator[Path]:
    """A directory mounted at its own path in the container (broken exports go there)."""
    d = Path(tempfile.mkdtemp(prefix="dflt-eval-shared-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def networked_parts(
    served_target_dir: Path, gate_run: GateRun, shared_dir: Path
) -> Iterator[P.Parts]:
    """sshd + pct shim + an LXC container in the host's network namespace, with the served
    target, the gate's run directory and `shared_dir` mounted at their own paths."""
    missing = P.have("/usr/sbin/sshd", "ssh-keygen", "lxc-create", "lxc-attach", "tmux")
    require_part(missing is None, missing or "")
    require_part(os.geteuid() == 0, "LXC containers need root")
    root = Path(tempfile.mkdtemp(prefix="dflt-eval-"))
    stack = contextlib.ExitStack()
    try:
        shared = (served_target_dir, gate_run.export.parent, shared_dir)
        ct = stack.enter_context(
            P.lxc_container(
                root / "ct-workdir",
                name=f"{P.NAME_PREFIX}{os.getpid()}-ev",
                host_network=True,
                shared=shared,
            )
        )
        sd = stack.enter_context(P.sshd(root / "sshd"))
    except (RuntimeError, OSError) as err:
        stack.close()
        require_part(False, f"real parts did not start: {err}")
        raise
    with stack:
        sd.map_file.write_text(f"{ct.ctid} {ct.name}\n")
        P.write_ct_conf(sd, ct.ctid, P.default_ct_conf(ct.name))
        try:
            yield P.Parts(sd, ct)
        finally:
            P.kill_tmux_in(ct)
    shutil.rmtree(root, ignore_errors=True)


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main(args)
    got = capsys.readouterr()
    return rc, got.out, got.err


@pytest.mark.parts
@pytest.mark.slow
def test_dflashctl_eval_in_the_container_against_the_served_engine(
    networked_parts: P.Parts,
    vllm_server: RunningEngine,
    served_target_dir: Path,
    gate_run: GateRun,
    shared_dir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    inv = P.pinned_inventory(networked_parts, tmp_path)
    tree = P.frozen_tree(tmp_path / "tree")
    assert cli([*inv, "deploy", "ct", "--tree", str(tree), "--no-memory-check", "--no-doctor"],
               capsys)[0] == 0  # fmt: skip
    prompts = tmp_path / "memorised.jsonl"  # the operator's local file: pushed into the job
    shutil.copyfile(gate_run.prompts, prompts)
    base = [*inv, "eval", "ct", "--target", str(served_target_dir), "--prompts", str(prompts)]
    base += ["--max-new-tokens", str(GATE_RESPONSE_TOKENS), "--device", "cpu"]

    rc, out, err = cli([*base, "--server", vllm_server.url, "--drafter", str(gate_run.export)],
                       capsys)  # fmt: skip
    assert rc == 0, out + err
    lines = out.splitlines()
    own = re.match(
        r"own loop   tau (\d\.\d{3}) over 1 turn\(s\), protocol exact, block 4", lines[0]
    )
    assert own is not None, out
    served = re.match(r"vllm 0\.32\.0 tau (\d\.\d{3}), per position \[([\d. ]+)\]", lines[1])
    assert served is not None and served.group(1) == own.group(1), out
    assert float(own.group(1)) >= 0.9 * 4  # the memorised sample: nearly the whole block
    assert lines[2] == "served/own tau 1.000: agree"
    assert "dflashctl: ct: prompt memorised.jsonl:1 turn 1: vllm tau=" in err  # followed
    job = sorted((networked_parts.container.workdir_host / "eval").iterdir())[-1]
    assert (job / "prompts" / "memorised.jsonl").read_bytes() == prompts.read_bytes()
    assert json.loads((job / "info.json").read_text())["drafter"] == str(gate_run.export)

    # --result prints it again; --json is trainer.eval's own document
    rc, again, _ = cli([*inv, "eval", "ct", "--result"], capsys)
    assert rc == 0 and again == out
    rc, raw, _ = cli([*inv, "eval", "ct", "--result", "--json"], capsys)
    doc = json.loads(raw)
    assert doc["engine"]["url"] == vllm_server.url and doc["served"]["summary"]["agree"]

    # status and the TUI's eval pane: served tau beside the (absent) in-training tau
    rc, text, _ = cli([*inv, "status", "ct"], capsys)
    assert f"  served: vllm 0.32.0 tau={own.group(1)}, own loop {own.group(1)} (agree) on " in text
    host = load_inventory(inv[1]).get("ct")
    transport = make_transport(host)

    async def poll() -> RunState:
        try:
            return apply_status(RunState("ct"), await RunControl(transport, host).status())
        finally:
            await transport.close()

    import asyncio

    pane = eval_text(asyncio.run(poll()), 0.0, 80).plain.splitlines()
    assert pane[1].startswith(f"served {own.group(1)} vllm 0.32.0 · own {own.group(1)} agree")

    # the project's loop on a drafter the engine does not serve (layer ids one off): DIFFER
    shifted = layer_ids_shifted(gate_run.export, shared_dir / "shifted", -1)
    rc, out, err = cli([*base, "--server", vllm_server.url, "--drafter", str(shifted)], capsys)
    assert rc == ExitCode.FAILED, out + err
    assert "served/own tau" in out and ": DIFFER: " in out, out
    said = [ln for ln in err.splitlines() if " failed: " in ln]
    assert (
        len(said) == 1
        and "acceptance differs from the project's loop beyond tolerance" in (said[0])
    ), err

    # no engine there: trainer.eval's line naming the URL, the job named
    nobody = f"http://127.0.0.1:{free_port()}"
    rc, out, err = cli([*base, "--server", nobody, "--drafter", str(gate_run.export)], capsys)
    assert rc == ExitCode.FAILED and not out, out + err
    assert re.search(rf"dflashctl: ct: eval \d{{8}}T\d{{6}}Z failed: .*{re.escape(nobody)}", err), (
        err
    )
    # the last eval with a summary is still the one status shows
    rc, text, _ = cli([*inv, "status", "ct"], capsys)
    assert "  served: vllm 0.32.0 tau=" in text and "(DIFFER: " in text


def _engine_processes(marker: str) -> list[str]:
    """This machine's processes whose command line holds `marker` (a job's directory)."""
    return [ln for ln in P.node_processes(re.escape(marker)) if "pgrep" not in ln]


@pytest.mark.parts
@pytest.mark.slow
async def test_eval_exports_a_checkpoint_and_serves_it_with_an_engine_it_starts(
    vllm_python: Path, served_target_dir: Path, tmp_path: Path
) -> None:
    """On a LocalTransport host (dflashctl demo's kind: this machine is the container): a real
    two-step training on the served target writes its checkpoints; `--checkpoint latest` is
    resolved to the newest step file, exported by trainer.export into the job, and served by a
    vLLM the job starts (`--serve-cmd`); both loops agree. A second eval stopped while its
    engine starts leaves no engine behind (--stop is Ctrl-C: trainer.eval stops what it
    started)."""
    import asyncio
    import tomllib

    from dflashctl.config.inventory import local_host
    from dflashctl.jobs.evals import EvalJob, EvalRequest
    from dflashctl.releases.deploy import deploy
    from dflashctl.releases.release import build_release
    from dflashctl.remote import LocalTransport
    from tests.serving.engine import ENGINE_ARGS, ENGINE_ENV, gate_config, serve_cmd
    from trainer.config.overlay import dump_toml, merge

    require_part(shutil.which("tmux") is not None, "tmux not installed")
    sock = tmp_path / "tmux"
    sock.mkdir()
    transport = LocalTransport(env={"TMUX_TMPDIR": str(sock)})
    host = local_host("loc", tmp_path / "wd", python=sys.executable, session="t")
    host = host.model_copy(update={"env": {**host.env, "OMP_NUM_THREADS": "1", **ENGINE_ENV}})
    tree = P.frozen_tree(tmp_path / "tree")
    await deploy(transport, host, release=build_release(tree), min_free_bytes=0, import_check=False)
    raw = tomllib.loads(gate_config(tmp_path, served_target_dir).read_text())
    run = Path(host.run_dir)
    run.mkdir(parents=True, exist_ok=True)
    (run / "config.toml").write_text(
        dump_toml(merge(raw, {"schedule": {"max_steps": 2}, "status": {"interval_s": 1}}))
    )
    try:
        ctl = RunControl(transport, host)
        await ctl.start(wait_s=0)
        end = asyncio.get_running_loop().time() + 900
        while not (status := await ctl.status()).finished:
            assert status.state in {"running", "stopped"}, status
            assert asyncio.get_running_loop().time() < end, "the training did not finish"
            await asyncio.sleep(2)
        req = EvalRequest(
            prompts=(GSM8K,),
            checkpoint="latest",
            serve_cmd=" ".join(serve_cmd(vllm_python)),
            serve_args=ENGINE_ARGS,
            max_new_tokens=16,
            device="cpu",
        )
        job = EvalJob(transport, host)
        started = await job.start(req)
        assert started.argv[:2] == ["sh", "-c"] and "trainer.export" in started.argv[2]
        lines: list[str] = []
        st = await job.jobs.follow(lines.append, lines.append, job_id=started.job_id, poll_s=5)
        assert st.state == "finished", lines
        assert st.info["step"] == 2 and st.info["checkpoint"].endswith("step-00000002.pt")
        summary = await job.summary(st)
        assert summary.agree and summary.served is not None, summary
        assert summary.served.tau == summary.own.tau and summary.turns == 2
        doc = await job.jobs.read_json(st, "result.json")
        engine = doc["engine"]
        assert isinstance(engine, dict) and engine["argv"] and engine["version"] == "0.32.0"
        assert f"{started.directory}/export" in engine["command"]  # it served the export
        assert (Path(started.directory) / "export" / "config.json").is_file()
        assert (Path(started.directory) / "engine.log").is_file()

        # stopped while its engine starts: Ctrl-C, and trainer.eval stops the engine
        second = await job.start(req)
        log = Path(second.directory) / "engine.log"
        end = asyncio.get_running_loop().time() + 600
        while not (log.is_file() and _engine_processes(f"{second.directory}/export")):
            assert (await job.jobs.state(job_id=second.job_id)).running, "ended before its engine"
            assert asyncio.get_running_loop().time() < end, "no engine process appeared"
            await asyncio.sleep(1)
        stopped = await job.jobs.stop(grace_s=120)
        assert stopped is not None and stopped.job_id == second.job_id
        after = await job.jobs.state(job_id=second.job_id)
        assert after.state == "cancelled", after
        end = asyncio.get_running_loop().time() + 60
        while left := _engine_processes(f"{second.directory}/export"):
            assert asyncio.get_running_loop().time() < end, f"an engine outlived its eval: {left}"
            await asyncio.sleep(1)
    finally:
        await transport.run(["tmux", "-L", "dflash", "kill-server"])
        await transport.close()
