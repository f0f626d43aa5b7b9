"""A group node's supervisor in front of its torchrun (c10d rendezvous, node 0 hosting it), as
dflashctl's `start GROUP` runs it, two nodes on this machine with their own run dirs and the
same group policy: torchrun restarts the whole worker group when a rank dies, every restart
resumes from node 0's newest checkpoint on both nodes (the losses after it are the
uninterrupted run's), a dead agent is brought back by its own node's supervisor, a crash loop
gives up once on every node, an exit that must not be restarted ends the group naming its node,
rank and reason, and a rank stopped dead is caught by node 0's stall watchdog.

Each test waits on its conditions within its one budget (tests/budget.py: the machine is shared)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests import budget
from trainer.config.overlay import merge

from .group_nodes import (
    c10d_argv,
    c10d_env,
    finish,
    free_port,
    node_dirs,
    run_state,
    start_node,
    supervised,
    supervisor_state,
)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
STEPS = 40
POLICY: tuple[str, ...] = ("--max-restarts", "3", "--backoff-s", "1")
POLICY += ("--stall-timeout-s", "30", "--startup-timeout-s", "300", "--kill-grace-s", "5")


@pytest.fixture(scope="module")
def raw(tiny_assets: dict[str, Any]) -> dict[str, Any]:
    return merge(
        tiny_assets,
        {
            "schedule": {"max_steps": STEPS},
            "status": {"interval_s": 0.3},
            "checkpoint": {"every_steps": 5, "keep_last": 3},
        },
    )


@pytest.fixture(scope="module")
def reference(raw: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> dict[int, float]:
    """The uninterrupted two-node run's loss per step."""
    nodes = node_dirs(tmp_path_factory.mktemp("reference"), raw)
    port = free_port()
    done = finish([start_node(c10d_argv(i, 2, port), d, c10d_env(i)) for i, d in enumerate(nodes)])
    assert [rc for rc, _ in done] == [0, 0], done
    return losses(nodes[0] / "run")


def losses(run_dir: Path) -> dict[int, float]:
    """Loss per step; after a resume the later row of a step wins (it is the one kept)."""
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def steps_logged(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(x)["step"] for x in path.read_text().splitlines() if x.strip()]


def start_group(
    nodes: list[Path], envs: tuple[dict[str, str], ...] = ({}, {}), policy: tuple[str, ...] = ()
) -> list[subprocess.Popen[str]]:
    port = free_port()
    procs = []
    for i, d in enumerate(nodes):
        env = {**c10d_env(i), "DFLASH_LAUNCH_ID": "launch-1", **envs[i]}
        torchrun = c10d_argv(i, 2, port, max_restarts=3)
        procs.append(start_node(supervised(i, torchrun, *POLICY, *policy), d, env))
    return procs


def wait_for(what: str, done: Callable[[], bool]) -> None:
    budget.until(done, what, every=0.2)


def node_pid(run_dir: Path) -> int:
    pid = run_state(run_dir)["pid"]
    assert isinstance(pid, int)
    return pid


def resumed_on_both(nodes: list[Path], after: int) -> None:
    """The group resumed from node 0's checkpoint (at least the one before step `after`; the
    ranks may train a step more while the kill lands), and both nodes finished the plan."""
    text = (nodes[0] / "run" / "status.log").read_text()
    resumes = re.findall(r"^Resuming from checkpoint: step=(\d+) ", text, re.M)
    assert resumes and after - 10 <= int(resumes[-1]) < STEPS, (resumes, after)
    assert run_state(nodes[1] / "run")["state"] == "finished"


def test_a_killed_rank_restarts_the_group_from_node_0s_checkpoint(
    tmp_path: Path, raw: dict[str, Any], reference: dict[int, float]
) -> None:
    nodes = node_dirs(tmp_path, raw)
    procs = start_group(nodes)
    wait_for("a checkpoint and step 12", lambda: len(steps_logged(nodes[0] / "run")) >= 12)
    killed_at = max(steps_logged(nodes[0] / "run"))
    os.kill(node_pid(nodes[1] / "run"), signal.SIGKILL)
    done = finish(procs, timeout=budget.left())
    assert [rc for rc, _ in done] == [0, 0], done
    resumed_on_both(nodes, killed_at)
    assert losses(nodes[0] / "run") == reference  # the steps after the resume: the same losses

    sup1, sup0 = supervisor_state(nodes[1] / "run"), supervisor_state(nodes[0] / "run")
    assert sup1["state"] == sup0["state"] == "finished", (sup0, sup1)
    (failure,) = sup1["failures"]
    assert (failure["node_rank"], failure["rank"], failure["signal"]) == (1, 1, 9), failure
    assert failure["attempt"] == 1 and failure["kind"] == "rank" and not failure["peer"]
    (restart,) = sup1["restarts"]
    assert (restart["attempt"], restart["rank"], restart["signal"]) == (2, 1, 9), restart
    assert restart["reason"] == "node 1 rank 1: signal 9" and restart["resumed_at"]
    assert [r["attempt"] for r in sup0["restarts"]] == [2]  # node 0 counted the same restart
    assert sup0["attempt"] == sup1["attempt"] == 2


def test_a_killed_agent_is_brought_back_by_its_own_supervisor(
    tmp_path: Path, raw: dict[str, Any], reference: dict[int, float]
) -> None:
    nodes = node_dirs(tmp_path, raw)
    procs = start_group(nodes)
    wait_for("a checkpoint and step 12", lambda: len(steps_logged(nodes[0] / "run")) >= 12)
    killed_at = max(steps_logged(nodes[0] / "run"))
    rank1 = node_pid(nodes[1] / "run")
    agent = supervisor_state(nodes[1] / "run")["agent_pid"]
    os.kill(agent, signal.SIGKILL)
    done = finish(procs, timeout=budget.left())
    assert [rc for rc, _ in done] == [0, 0], done
    resumed_on_both(nodes, killed_at)
    assert losses(nodes[0] / "run") == reference
    assert not Path(f"/proc/{rank1}").exists()  # the dead agent's worker was ended
    sup1 = supervisor_state(nodes[1] / "run")
    assert [r["kind"] for r in sup1["restarts"]] == ["agent"], sup1["restarts"]
    assert sup1["restarts"][0]["reason"] == "node 1 agent: killed by signal 9"
    assert sup1["agent_pid"] != agent and sup1["state"] == "finished"


def test_a_crash_loop_gives_up_once_on_every_node(tmp_path: Path, raw: dict[str, Any]) -> None:
    """Node 1's rank fails on its third micro-batch at every start: the group restarts twice
    (max_restarts 2), then both nodes give up, each once, naming the restarts."""
    nodes = node_dirs(tmp_path, raw)
    procs = start_group(
        nodes, ({}, {"DFLASH_FAULT": "drafter:3"}), ("--max-restarts", "2", "--backoff-s", "1")
    )
    done = finish(procs, timeout=budget.left())
    assert all(rc != 0 for rc, _ in done), done
    for d in nodes:
        sup = supervisor_state(d / "run")
        assert sup["state"] == "gave-up" and sup["gave_up"], sup
        assert sup["detail"].startswith("gave up after 2 group restarts"), sup["detail"]
        assert len(sup["restarts"]) == 2, sup["restarts"]
        log = (d / "run" / "status.log").read_text()
        assert len(re.findall(r"^Supervisor gave up", log, re.M)) == 1, log
    failures = supervisor_state(nodes[1] / "run")["failures"]
    assert [f["attempt"] for f in failures] == [1, 2, 3], failures
    assert {(f["rank"], f["exit_status"]) for f in failures} == {(1, 1)}
    assert all("InjectedFault" in (f["error"] or "") for f in failures), failures


def test_an_exit_that_must_not_be_restarted_ends_the_group_naming_node_rank_and_reason(
    tmp_path: Path, raw: dict[str, Any], tiny_assets: dict[str, Any]
) -> None:
    """Node 1 has no copy of the store (real data, nothing the trainer builds): its rank
    refuses with exit 2 at every start. Node 1's supervisor ends its agent at the first one,
    naming node 1, rank 1 and the trainer's reason; node 0 waits in the rendezvous, bounded by
    its timeout, and ends without training again."""
    real = merge(raw, {"data": {"store": "data/store"}})
    del real["data"]["synthetic"]
    nodes = node_dirs(tmp_path, real)
    shutil.copytree(Path(tiny_assets["data"]["store"]), nodes[0] / "data" / "store")
    port = free_port()
    procs = []
    for i, d in enumerate(nodes):
        torchrun = c10d_argv(i, 2, port, max_restarts=3)
        torchrun[torchrun.index("--rdzv-conf") + 1] = (
            f"is_host={'true' if i == 0 else 'false'},join_timeout=20"
        )
        env = {**c10d_env(i), "DFLASH_LAUNCH_ID": "launch-1"}
        procs.append(start_node(supervised(i, torchrun, *POLICY), d, env))
    done = finish(procs, timeout=budget.left())
    assert all(rc != 0 for rc, _ in done), done
    sup1, sup0 = supervisor_state(nodes[1] / "run"), supervisor_state(nodes[0] / "run")
    missing = nodes[1] / "data" / "store"
    assert sup1["state"] == "not-restarted", sup1
    assert sup1["detail"].startswith(
        f"node 1 rank 1 exit 2: exit 2 is in no_restart_exit_codes: rank 1: data.store: {missing}"
    ), sup1["detail"]
    assert sup1["restarts"] == [] and sup1["attempt"] == 1
    log1 = (nodes[1] / "run" / "status.log").read_text()
    assert len(re.findall(r"^Not restarting trainer:", log1, re.M)) == 1, log1
    assert sup0["state"] == "not-restarted" and "rendezvous timed out" in sup0["detail"], sup0
    assert sup0["attempt"] == 1  # no round after the refusal completed: nothing trained again


def test_a_rank_stopped_dead_is_caught_by_node_0s_watchdog(
    tmp_path: Path, raw: dict[str, Any], reference: dict[int, float]
) -> None:
    """SIGSTOP node 1's rank: node 0's rank 0 waits in its all-reduce and makes no progress;
    within the stall timeout node 0's supervisor dumps and kills its ranks, torchrun restarts
    the group (node 1's stopped rank is ended by its agent), and the run ends on the
    uninterrupted losses."""
    nodes = node_dirs(tmp_path, raw)
    procs = start_group(nodes, policy=("--stall-timeout-s", "20"))
    wait_for("a checkpoint and step 12", lambda: len(steps_logged(nodes[0] / "run")) >= 12)
    os.kill(node_pid(nodes[1] / "run"), signal.SIGSTOP)
    done = finish(procs, timeout=budget.left())
    assert [rc for rc, _ in done] == [0, 0], done
    assert losses(nodes[0] / "run") == reference
    sup0 = supervisor_state(nodes[0] / "run")
    stalls = [f for f in sup0["failures"] if f["kind"] == "stall"]
    assert [f["reason"] for f in stalls] == ["stalled 20 s"], sup0["failures"]
    assert sup0["restarts"][0]["reason"] == "node 0 rank 0: stalled 20 s", sup0["restarts"]
    console = (nodes[0] / "run" / "console.log").read_text()
    assert "made no progress in status.log" in console and "then SIGKILL" in console
