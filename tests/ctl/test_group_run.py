"""A group end to end through the CLI, on real parts: two "Proxmox hosts" (two loopback sshd,
each with the pct shim) and two LXC containers in the host's network namespace
(`lxc.net.0.type = none`, so gloo meets on 127.0.0.1), the tiny CPU config with one rank per
node, each node under its supervisor in front of torchrun (c10d, node 0 hosting it), with the
group's one restart policy (short figures here):

deploy GROUP + start GROUP -> both nodes step, status GROUP --json shows world size 2 and the
same step on both; the first K losses equal a 2-rank single-host run of the same config;
stop GROUP -> one complete checkpoint on node 0, none half-written, none on node 1; restart
GROUP resumes at the next step on both. Then, with nobody acting: a SIGKILLed rank on node 1
restarts the group from node 0's checkpoint (the steps trained again have the same losses) and
status names node 1, rank 1, signal 9; a SIGKILLed agent comes back through its own node's
supervisor, node 0's too when its new agent gets the higher pid (c10d then ranks node 0 second,
and node 0's first process is still global rank 0); node 1's sshd stopped longer than the stall
timeout is node 1 unreachable while the group trains on, nothing restarts, and it is reachable
again after; `stop GROUP` during a restart backoff stops for good; a rank that exits 2 at every
start is named with its node, rank and reason, and not restarted.

Each container has its own /data (a directory of this host's per node, as two Proxmox nodes
have their own disks): the config names /data/store and /data/target, and each node's first
process builds its own synthetic store and tiny target there at the first start. A config whose
store is real data (no `data.synthetic`) is refused by `start` until every node has it, one line
per node.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.runconfig import config_hash_of_file
from tests import budget
from tests.conftest import require_part
from tests.ctl import parts as P
from trainer.config.overlay import dump_toml, merge

REPO = Path(__file__).resolve().parents[2]
TINY = REPO / "configs" / "tiny-cpu.toml"
K = 8  # losses compared with the single-host run
SESSION = "dflash-g"
pytestmark = [pytest.mark.parts, pytest.mark.slow, pytest.mark.timeout(900)]


@dataclass(frozen=True)
class Pair:
    inv: list[str]  # --hosts FILE
    config: Path
    raw: dict[str, Any]
    containers: tuple[P.Container, P.Container]
    tree: Path
    data: tuple[Path, Path] | None = None
    sshds: tuple[P.Sshd, ...] = ()


DATA = "/data"  # each node's own
STALL_S = 45
BACKOFF_S = 15  # an agent restart's backoff: long enough to stop the group inside it
GROUP_POLICY = (
    "max_restarts = 5",
    "restart_window_s = 3600",
    f"restart_backoff_s = {BACKOFF_S}",
    f"stall_timeout_s = {STALL_S}",
    "startup_timeout_s = 600",
    "rendezvous_timeout_s = 120",
)


def run_config(assets: str) -> dict[str, Any]:
    """The tiny config, its store and target under `assets` (absolute), many epochs (the run
    must outlast the test), only the stop's checkpoints."""
    raw = tomllib.loads(TINY.read_text())
    return merge(
        raw,
        {
            "data": {"store": f"{assets}/store"},
            "model": {"target_dir": f"{assets}/target"},
            "schedule": {"epochs": 20},
            "status": {"interval_s": 1, "rate_window_s": 5},
            "checkpoint": {"every_steps": 100000, "every_minutes": 600.0, "keep_last": 3},
        },
    )


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    missing = P.have("/usr/sbin/sshd", "ssh-keygen", "lxc-create", "lxc-attach", "tmux")
    require_part(missing is None, missing or "")
    require_part(os.geteuid() == 0, "LXC containers need root")
    require_part(TINY.is_file(), "configs/tiny-cpu.toml is not in this checkout")
    base = tmp_path_factory.mktemp("group")
    tree = P.frozen_tree(base / "tree")
    raw = run_config(DATA)
    config = base / "run.toml"
    config.write_text(dump_toml(raw))
    with contextlib.ExitStack() as stack:
        try:
            got = stack.enter_context(
                P.group_pair(
                    base,
                    run_config=config,
                    private=DATA,
                    session=SESSION,
                    group_keys=GROUP_POLICY,
                )
            )
        except (RuntimeError, OSError) as err:
            require_part(False, f"real parts did not start: {err}")
            raise
        yield Pair(
            ["--hosts", str(got.inventory)], config, raw, got.containers, tree, got.data, got.sshds
        )


def cli(pair: Pair, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    capsys.readouterr()
    rc = cli_main([*pair.inv, *args])
    got = capsys.readouterr()
    return rc, got.out + got.err


def group_status(pair: Pair, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    rc, out = cli(pair, capsys, "status", "g", "--json")
    assert rc == 0, out
    got = json.loads(out)
    assert isinstance(got, list) and len(got) == 1 and isinstance(got[0], dict), got
    return got[0]


def wait_group(
    pair: Pair,
    capsys: pytest.CaptureFixture[str],
    pred: Callable[[dict[str, Any]], bool],
    *,
    allow_failed: bool = False,
) -> dict[str, Any]:
    """The group's `status --json` until `pred` holds, within the test's one budget."""
    seen: list[dict[str, Any]] = []

    def holds() -> dict[str, Any] | None:
        seen[:] = [group_status(pair, capsys)]
        if not allow_failed:
            assert seen[0]["state"] != "failed", f"the group failed: {seen[0]}"
        return seen[0] if pred(seen[0]) else None

    return budget.until(
        holds, budget.described(pred), every=1, detail=lambda: f"last status: {seen}"
    )


def node_steps(st: dict[str, Any]) -> list[int | None]:
    return [n["step"] for n in st["nodes"]]


def metrics(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def single_host_losses(raw: dict[str, Any], tmp: Path, tree: Path, steps: int = K) -> list[float]:
    """The first `steps` losses of the same config as two ranks of one host (torchrun
    --standalone): the uninterrupted run; `max_steps` ends it there (it changes no schedule:
    the LR still spans every epoch)."""
    cfg = tmp / "single.toml"
    here = merge(raw, run_config(str(tmp / "assets")))  # the same seeded store and target, here
    cfg.write_text(dump_toml(merge(here, {"schedule": {"max_steps": steps}})))
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    argv += ["-m", "trainer", "--config", str(cfg), "--run-dir", str(tmp / "single-run")]
    out = subprocess.run(
        argv, cwd=tree, env=P.tree_env(tree), capture_output=True, text=True, timeout=budget.left()
    )
    assert out.returncode == 0, out.stderr[-3000:]
    rows = metrics(tmp / "single-run")
    return [r["loss"] for r in rows]


def pane_pid(ct: P.Container) -> int:
    tmux = ["tmux", "-L", "dflash", "display-message", "-p", "-t", f"={SESSION}:", "#{pane_pid}"]
    r = subprocess.run(
        ["lxc-attach", "-n", ct.name, "--", *tmux],
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )
    assert r.returncode == 0 and r.stdout.strip().isdigit(), r.stderr
    return int(r.stdout.strip())


def test_a_group_steps_stops_and_resumes_as_one(
    pair: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ws0, ws1 = (ct.workdir_host for ct in pair.containers)
    # the reference first, while the cores are free: 2 ranks on one host, same config
    reference = single_host_losses(pair.raw, tmp_path, pair.tree)
    assert len(reference) == K

    # a store of real data (nothing the trainer builds): start checks every node has it, and
    # names each node and path that lacks it, one line each, before starting anything
    real = tmp_path / "real.toml"
    real_raw = merge(pair.raw, {})
    del real_raw["data"]["synthetic"]
    real.write_text(dump_toml(real_raw))
    rc, out = cli(
        pair,
        capsys,
        "deploy",
        "g",
        "--config",
        str(real),
        "--no-memory-check",
        "--tree",
        str(pair.tree),
    )
    assert rc == 0, out
    releases = set(re.findall(r"^n[01]: release (\w+): sent", out, re.M))
    assert len(releases) == 1 and "on all 2 nodes" in out, out
    rc, out = cli(pair, capsys, "start", "g")
    assert rc == 1, out
    for n in ("n0", "n1"):
        line = (
            f"dflashctl: {n}: data.store {DATA}/store: no token store there (no manifest.json); "
            f"every node reads its own copy: put it at that path on {n}"
        )
        assert line in out.splitlines(), out
    assert "model.target_dir" not in out, out  # the tiny target is built by each node itself
    assert not list((ws0 / "run").glob("metrics.jsonl")), "a refused start started something"

    rc, out = cli(pair, capsys, "deploy", "g", "--no-memory-check", "--tree", str(pair.tree))
    assert rc == 0, out

    # a node with another config: start refuses, naming the nodes and their hashes
    other = tmp_path / "other.toml"
    other.write_text(P.halve_lr(pair.config.read_text())[0])
    rc, out = cli(
        pair,
        capsys,
        "deploy",
        "n1",
        "--config",
        str(other),
        "--no-memory-check",
        "--tree",
        str(pair.tree),
    )
    assert rc == 0, out
    rc, out = cli(pair, capsys, "start", "g")
    assert rc == 1, out
    h0, h1 = config_hash_of_file(pair.config), config_hash_of_file(other)
    assert f"the nodes' config hashes differ (n0 {h0}, n1 {h1})" in out, out
    assert not list((ws0 / "run").glob("metrics.jsonl")), "a refused start started something"
    rc, out = cli(pair, capsys, "deploy", "g", "--no-memory-check", "--tree", str(pair.tree))
    assert rc == 0, out

    rc, out = cli(pair, capsys, "start", "g", "--wait-s", "240")
    assert rc == 0, out
    assert "n0: node 0 of g" in out and "n1: node 1 of g" in out, out
    assert "--rdzv-backend c10d" in out and "--group-node 1" in out, out
    assert "trainer.supervise" in out and "each under its supervisor" in out, out
    st = wait_group(
        pair,
        capsys,
        lambda s: s["state"] == "running" and all((x or 0) > 0 for x in node_steps(s)),
    )
    # each node's own step (its first local rank records it at every status interval): both
    # train; that they are the same step is checked once they stopped (below)
    assert st["world_size"] == 2 and st["failed"] is None
    assert [n["rank_range"] for n in st["nodes"]] == [[0, 1], [1, 2]]
    assert len({n["release"] for n in st["nodes"]}) == 1

    # the loss sequence over the first K steps is the single-host run's
    budget.until(lambda: len(metrics(ws0 / "run")) >= K, "node 0's first K metrics rows", every=1)
    assert [r["loss"] for r in metrics(ws0 / "run")[:K]] == reference
    assert pair.data is not None
    for d in pair.data:  # each node built its own store and target in its own /data
        assert (d / "store" / "manifest.json").is_file() and (
            d / "target" / "config.json"
        ).is_file()

    rc, out = cli(pair, capsys, "stop", "g", "--timeout", f"{budget.left():.0f}")
    assert rc == 0, out
    m = re.search(r"^n0: node 0: stopped \(\w+\); checkpoint step (\d+)", out, re.M)
    assert m, out
    step = int(m.group(1))
    ckpt_dir = ws0 / "run" / "checkpoints"
    assert sorted(p.name for p in ckpt_dir.iterdir()) == [f"step-{step:08d}.pt"]  # no tmp
    assert not list((ws1 / "run").glob("checkpoints/*"))  # only node 0 keeps checkpoints
    st = group_status(pair, capsys)
    assert st["state"] == "stopped" and [n["state"] for n in st["nodes"]] == ["stopped"] * 2
    assert node_steps(st) == [step, step]

    rc, out = cli(pair, capsys, "logs", "g", "-n", "2")
    assert rc == 0 and f"n0| Checkpoint saved: step={step} " in out, out
    assert all(ln.startswith(("n0| ", "n1| ")) for ln in out.splitlines()), out
    rc, out = cli(pair, capsys, "attach", "g", "--print")
    assert rc == 0 and "attaching to node 0 (n0)" in out and SESSION in out, out

    before = len(metrics(ws0 / "run"))
    rc, out = cli(
        pair, capsys, "restart", "g", "--timeout", f"{budget.left():.0f}", "--tree", str(pair.tree)
    )
    assert rc == 0, out
    st = wait_group(
        pair,
        capsys,
        lambda s: s["state"] == "running" and all((x or 0) > step for x in node_steps(s)),
    )
    resumed = [r["step"] for r in metrics(ws0 / "run")[before:]]
    assert resumed[:2] == [step + 1, step + 2], resumed  # the next step, not step 0 or 1


def container(ct: P.Container, *argv: str) -> str:
    r = subprocess.run(
        ["lxc-attach", "-n", ct.name, "--", *argv],
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )
    assert r.returncode == 0, (argv, r.stderr)
    return r.stdout


def read_json(path: Path) -> dict[str, Any]:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def supervisor(ws: Path) -> dict[str, Any]:
    """A node's supervisor.json, read on this host (its workdir is a host directory)."""
    return read_json(ws / "run" / "supervisor.json")


def trained_again(pair: Pair, capsys: pytest.CaptureFixture[str], attempt: int) -> dict[str, Any]:
    """Wait until the group runs attempt `attempt` and node 0 stepped past its resume."""
    ws0 = pair.containers[0].workdir_host

    def done(s: dict[str, Any]) -> bool:
        if s["state"] != "running" or (s["attempt"] or 0) < attempt:
            return False
        log = (ws0 / "run" / "status.log").read_text()
        resumes = re.findall(r"^Resuming from checkpoint: step=(\d+) ", log, re.M)
        return bool(resumes) and (s["step"] or 0) > int(resumes[-1]) + 2

    return wait_group(pair, capsys, done)


def resumed_from(run_dir: Path) -> int:
    """The step node 0's last resume started from."""
    log = (run_dir / "status.log").read_text()
    return int(re.findall(r"^Resuming from checkpoint: step=(\d+) ", log, re.M)[-1])


def latest_losses(run_dir: Path) -> dict[int, float]:
    """Node 0's loss per step; a step trained again after a resume: its later row."""
    return {row["step"]: row["loss"] for row in metrics(run_dir)}


def test_a_killed_rank_restarts_the_group_from_node_0s_checkpoint(
    pair: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL node 1's rank while the group trains: torchrun restarts the whole group by
    itself, both nodes resume from node 0's newest checkpoint (the one node 0's rank wrote as
    torchrun stopped it), the first losses after the resume are an uninterrupted run's from
    that step, and status names node 1, rank 1, signal 9 (one restart)."""
    ws0, ws1 = (ct.workdir_host for ct in pair.containers)
    st = wait_group(pair, capsys, lambda s: s["state"] == "running" and (s["step"] or 0) > 3)
    attempt = st["attempt"]
    rank1 = read_json(ws1 / "run" / "run-state.json")["pid"]
    container(pair.containers[1], "kill", "-KILL", str(rank1))
    st = trained_again(pair, capsys, attempt + 1)
    resumed = resumed_from(ws0 / "run")
    n = 4
    budget.until(
        lambda: max(latest_losses(ws0 / "run")) >= resumed + n,
        "node 0 to train 4 steps after the resume",
        every=1,
    )
    uninterrupted = single_host_losses(pair.raw, tmp_path, pair.tree, steps=resumed + n)
    after = latest_losses(ws0 / "run")
    assert [after[s] for s in range(resumed + 1, resumed + n + 1)] == uninterrupted[resumed:]
    assert (ws1 / "run" / "run-state.json").is_file()
    assert read_json(ws1 / "run" / "run-state.json")["step"] >= resumed  # node 1 resumed too
    first = [r for r in st["restarts"] if r["attempt"] == attempt]
    assert first and (first[0]["host"], first[0]["rank"], first[0]["reason"]) == (
        "n1",
        1,
        "signal 9",
    ), st["restarts"]
    assert first[0]["resumed"], st["restarts"]
    _, out = cli(pair, capsys, "status", "g")
    assert f"attempt {attempt}: node 1 (n1) rank 1: signal 9 -> the group restarted" in out, out
    assert [n["rank_range"] for n in st["nodes"]] == [[0, 1], [1, 2]]


def test_killed_agents_come_back_and_node_0_stays_rank_0(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGKILL node 1's torchrun agent: node 1's supervisor starts another, which rejoins.
    Then node 0's: both agents go (node 1's loses node 0's store) and come back by their
    supervisors; c10d ranks node 0's agent second (its address sorts after node 1's, see
    parts.NODE_ADDRESSES), before and after, and node 0's first process is global rank 0 all
    along: it resumes, writes the status lines and alone keeps checkpoints."""
    ws0, ws1 = (ct.workdir_host for ct in pair.containers)
    st = wait_group(pair, capsys, lambda s: s["state"] == "running")
    attempt = st["attempt"]
    agent1 = supervisor(ws1)["agent_pid"]
    container(pair.containers[1], "kill", "-KILL", str(agent1))
    st = trained_again(pair, capsys, attempt + 1)
    sup1 = supervisor(ws1)
    assert sup1["agent_pid"] != agent1 and sup1["restarts"][-1]["kind"] == "agent", sup1
    assert sup1["restarts"][-1]["reason"] == "node 1 agent: killed by signal 9"

    assert supervisor(ws0)["group_rank"] == 1  # c10d: node 0 second
    attempt = st["attempt"]
    agent0 = supervisor(ws0)["agent_pid"]
    container(pair.containers[0], "kill", "-KILL", str(agent0))
    st = trained_again(pair, capsys, attempt + 1)
    sup0 = supervisor(ws0)
    assert sup0["agent_pid"] != agent0 and sup0["group_rank"] == 1, sup0  # c10d: still second
    assert read_json(ws0 / "run" / "run-state.json")["rank_range"] == [0, 1]
    assert read_json(ws1 / "run" / "run-state.json")["rank_range"] == [1, 2]
    assert not (ws1 / "run" / "checkpoints").exists()  # checkpoints are still node 0's alone


def test_a_lost_link_is_not_a_lost_node(
    pair: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 1's sshd stopped (SIGSTOP: connections hang) for longer than the stall timeout:
    status says node 1 unreachable and the group degraded while node 0's step advances;
    nothing restarts; the watch says unreachable, then recovered when sshd runs again."""
    ws0, ws1 = (ct.workdir_host for ct in pair.containers)
    st = wait_group(pair, capsys, lambda s: s["state"] == "running")
    restarts = [len(supervisor(ws)["restarts"]) for ws in (ws0, ws1)]
    inv = tmp_path / "hosts.toml"  # the same, with a short unreachable alert for the watch
    inv.write_text("unreachable_alert_s = 5\n" + Path(pair.inv[1]).read_text())
    inv.chmod(0o600)
    watch = subprocess.Popen(
        [*WATCH, "--hosts", str(inv), "watch", "g", *WATCH_FLAGS],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        with P.stopped_sshd(pair.sshds[1]):
            stopped_at, step = time.monotonic(), st["step"] or 0
            wait_group(
                pair,
                capsys,
                lambda s: (
                    s["state"] == "degraded"
                    and s["nodes"][1]["state"] == "unreachable"
                    and (s["step"] or 0) > step
                    and time.monotonic() - stopped_at > STALL_S + 5
                ),
            )
            summary = group_status(pair, capsys)["summary"]
            assert summary.startswith("g: degraded: n1 unreachable"), summary
            assert [len(supervisor(ws)["restarts"]) for ws in (ws0, ws1)] == restarts
            assert supervisor(ws1)["state"] == "running"  # its own supervisor: nothing happened
        wait_group(pair, capsys, lambda s: s["state"] == "running")
        budget.until(
            lambda: "recovered" in _read_some(watch),
            "the watch to say recovered",
            detail=lambda: _read_some(watch),
        )
    finally:
        out = _stop_watch(watch)
    assert re.search(r" n1 unreachable: unreachable since ", out), out
    assert re.search(r" n1 recovered \(unreachable\): reachable again after ", out), out
    assert " restarted" not in out and " crashed" not in out, out
    assert [len(supervisor(ws)["restarts"]) for ws in (ws0, ws1)] == restarts


WATCH = [sys.executable, "-m", "dflashctl"]
WATCH_FLAGS = ["--interval-s", "2", "--burst-s", "1", "--no-gpu", "--no-notify"]
_WATCH_OUT: dict[int, str] = {}


def _read_some(proc: subprocess.Popen[str]) -> str:
    """What the watch printed so far (its stdout is read without blocking)."""
    import fcntl

    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_NONBLOCK)
    try:
        chunk = proc.stdout.read() or ""
    except (BlockingIOError, TypeError):
        chunk = ""
    _WATCH_OUT[proc.pid] = _WATCH_OUT.get(proc.pid, "") + chunk
    time.sleep(0.5)
    return _WATCH_OUT[proc.pid]


def _stop_watch(proc: subprocess.Popen[str]) -> str:
    """SIGINT the watch (it flushes its window and drains), then everything it printed."""
    import fcntl

    proc.send_signal(signal.SIGINT)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    rest = proc.communicate(timeout=budget.left())[0] or ""
    return _WATCH_OUT.get(proc.pid, "") + rest


def test_stop_during_a_restart_backoff_stops_for_good(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 1's agent killed, its supervisor in the restart backoff: `stop g` ends both nodes
    and nothing comes back after the backoff would have ended."""
    ws1 = pair.containers[1].workdir_host
    wait_group(pair, capsys, lambda s: s["state"] == "running")
    container(pair.containers[1], "kill", "-KILL", str(supervisor(ws1)["agent_pid"]))
    budget.until(
        lambda: supervisor(ws1).get("state") == "restarting",
        "node 1's supervisor in its restart backoff",
        every=0.2,
        detail=lambda: str(supervisor(ws1)),
    )
    stopped_at = time.monotonic()
    rc, out = cli(pair, capsys, "stop", "g", "--timeout", f"{budget.left():.0f}")
    assert rc in (0, 1), out  # node 0's checkpoint may or may not come in time; both stop
    sup1 = supervisor(ws1)
    assert sup1["state"] == "stopped" and "during the restart backoff" in sup1["detail"], sup1
    while time.monotonic() - stopped_at < BACKOFF_S + 10:  # past the backoff: still nothing
        for ct in pair.containers:
            assert P.node_processes_in(ct, "torch.distributed.run") == [], ct.name
        time.sleep(1)
    st = group_status(pair, capsys)
    assert st["state"] == "stopped", st


def test_a_rank_that_refuses_at_every_start_is_named_and_not_restarted(
    pair: Pair, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 1's target made unreadable: its rank exits 2 (a user error) at its first start.
    start fails naming node 1 with its own error line; status names node 1, rank 1 and the
    reason, once; nothing was restarted on node 1."""
    ws1 = pair.containers[1].workdir_host
    assert pair.data is not None
    target = pair.data[1] / "target" / "config.json"
    good = target.read_text()
    target.write_text("{}\n")
    try:
        rc, out = cli(pair, capsys, "start", "g", "--wait-s", "240")
        assert rc == 1, out
        line = next(ln for ln in out.splitlines() if ln.startswith("dflashctl: group 'g': node 1"))
        assert "n1: " in line and "rank 1: " in line and "cannot read the target config" in line
        assert "=====" not in out, out
        st = group_status(pair, capsys)
        assert st["state"] in ("failed", "stopped"), st
        sup1 = supervisor(ws1)
        assert sup1["state"] == "not-restarted" and sup1["restarts"] == [], sup1
        assert sup1["detail"].startswith("node 1 rank 1 exit 2: exit 2 is in no_restart_exit_codes")
    finally:
        target.write_text(good)


def test_a_crash_loop_gives_up_once_with_one_notification(
    pair: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Node 1's rank fails at its third micro-batch at every start (DFLASH_FAULT in n1's env),
    the group may restart once (max_restarts = 1): one restart, then every node gives up, once,
    and `dflashctl watch g` sends one notification for all of it to a real local receiver,
    naming each attempt's node, rank and reason."""
    from tests.ctl.test_notify import Receiver

    ws0, ws1 = (ct.workdir_host for ct in pair.containers)
    rx = Receiver()
    rx.thread.start()
    urls = tmp_path / "notify-urls"
    urls.write_text(rx.url() + "\n")
    urls.chmod(0o600)
    text = Path(pair.inv[1]).read_text().replace("max_restarts = 5", "max_restarts = 1")
    plain = 'env = { OMP_NUM_THREADS = "1" }'
    at = text.rindex(plain)  # n1's, the last host in the file
    text = (
        text[:at]
        + 'env = { OMP_NUM_THREADS = "1", DFLASH_FAULT = "drafter:3" }'
        + text[at + len(plain) :]
    )
    inv = tmp_path / "hosts.toml"
    inv.write_text(f'notify_urls_file = "{urls}"\n' + text)
    inv.chmod(0o600)
    loop = Pair(["--hosts", str(inv)], pair.config, pair.raw, pair.containers, pair.tree)
    flags = ["--interval-s", "2", "--burst-s", "600", "--no-gpu"]  # one window for it all
    watch = subprocess.Popen(
        [*WATCH, "--hosts", str(inv), "watch", "g", *flags],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        rc, out = cli(loop, capsys, "start", "g", "--wait-s", "0")  # its failures are the test
        assert rc == 0, out
        st = wait_group(loop, capsys, lambda s: s["state"] == "gave-up", allow_failed=True)
        budget.until(  # the watch saw the end too
            lambda: " g gave-up: " in _read_some(watch),
            "the watch to say gave-up",
            detail=lambda: _read_some(watch),
        )
    finally:
        said = _stop_watch(watch)
        rx.server.shutdown()
        rx.server.server_close()
    assert [a["attempt"] for a in st["restarts"]] == [1, 2], st["restarts"]
    assert all((a["host"], a["rank"], a["reason"]) == ("n1", 1, "exit 1") for a in st["restarts"])
    for ws in (ws0, ws1):
        log = (ws / "run" / "status.log").read_text()
        assert len(re.findall(r"^Supervisor gave up", log, re.M)) == 1, log
    assert len(rx.received) == 1, (rx.received, said)
    message = json.dumps(rx.received[0])
    assert "gave-up" in message and "attempt 1: node 1 (n1) rank 1: exit 1" in message, message
    assert "attempt 2: node 1 (n1) rank 1: exit 1" in message, message
    assert "InjectedFault" in message, message
    assert re.search(r" g gave-up: g: gave-up: gave up after 1 group restarts", said), said
    cli(loop, capsys, "stop", "g")  # the dead panes go


def test_one_node_unreachable_is_that_node_not_the_group(
    pair: Pair, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A group whose node 1 cannot be reached: deploy reaches node 0 and names node 1 in one
    line (exit 1); status calls the group degraded, node 1 unreachable, nothing failed."""
    cli(pair, capsys, "stop", "n0")  # a dead pane left by the test before: cleared
    inv = Path(pair.inv[1])
    text = inv.read_text()
    key = re.search(r'identity_file = "([^"]+)"', text)
    assert key
    gone = [
        "[hosts.gone]",
        'address = "127.0.0.1"',
        f"port = {P.free_port()}",  # nothing listens: connection refused
        "ctid = 4243",
        'workdir = "/srv/dflash9"',
        'node_address = "127.0.0.1"',
        f'identity_file = "{key.group(1)}"',
    ]
    lost = tmp_path / "hosts.toml"
    lost.write_text(
        text.replace('hosts = ["n0", "n1"]', 'hosts = ["n0", "gone"]') + "\n".join(gone) + "\n"
    )
    lost.chmod(0o600)
    other = Pair(["--hosts", str(lost)], pair.config, pair.raw, pair.containers, pair.tree)
    rc, out = cli(other, capsys, "deploy", "g", "--no-memory-check", "--tree", str(pair.tree))
    assert rc == 1, out
    assert re.search(r"^n0: release \w+", out, re.M), out  # node 0 still deployed, reported
    assert re.search(r"^dflashctl: gone: .*", out, re.M), out  # node 1: one line, named
    assert "deploy failed on gone" in out, out
    st = group_status(other, capsys)
    assert st["state"] == "degraded" and st["failed"] is None, st
    assert [n["state"] for n in st["nodes"]] == ["stopped", "unreachable"], st
    rc, out = cli(other, capsys, "start", "g")
    assert rc == 3 and "not starting" in out and "gone" in out, out
