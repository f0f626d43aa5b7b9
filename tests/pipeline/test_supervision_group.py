"""A group node's supervisor, its pure pieces: torchrun's log lines as events, the group's
restart budget, what an agent's ending means, the node's place from the torchrun argv, and the
once-per-launch rule for --fresh and an explicit --resume (torch-free, fast)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from trainer.config.policy import Policy
from trainer.pipeline.launch_env import launch_rank, mark_launch, repeated_launch
from trainer.supervision.agent import (
    AgentLog,
    AgentTee,
    Exhausted,
    RendezvousDone,
    RendezvousFailed,
    Rendezvousing,
    Restarting,
    WorkerFailed,
)
from trainer.supervision.group import (
    AgentLife,
    GroupBudget,
    GroupNode,
    agent_verdict,
    group_node_of,
    worker_no_restart,
)
from trainer.supervision.restarts import GiveUp, NextRestart

P = "I1205 15:10:52.253000 14417 torch/distributed/elastic/agent/server/api.py:553]"
# torch 2.13's lines, as the real agent printed them (tests/pipeline/test_group_supervise.py
# runs the real one)
AGENT_LINES = [
    "I1205 15:10:40.000000 14417 torch/distributed/elastic/agent/server/api.py:707] [default] "
    "Rendezvous'ing worker group",
    f"{P} [default] Rendezvous complete for workers. Result:",
    f"{P}   restart_count=0",
    f"{P}   master_addr=127.0.0.1",
    f"{P}   master_port=59759",
    f"{P}   group_rank=1",
    f"{P}   group_world_size=2",
    f"{P} ",
    "[rank0]: RuntimeError: Connection closed by peer [127.0.0.1]:13194.",
    "E1205 14:51:24.514000 26238 torch/distributed/elastic/multiprocessing/api.py:1002] failed "
    "(exitcode: -9) local_rank: 0 (pid: 27872) of binary: /venv/bin/python",
    "I1205 14:51:24.600000 26238 torch/distributed/elastic/agent/server/api.py:942] [default] "
    "Worker group FAILED. 3/3 attempts left; will restart worker group",
    "I1205 14:51:30.000000 26238 torch/distributed/elastic/agent/server/api.py:962] [default] "
    "Detected 1 new nodes from group_rank=0; will restart worker group",
    "    raise RendezvousTimeoutError(",
    "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: ",
    "torch.distributed.elastic.rendezvous.api.RendezvousConnectionError: The connection to the "
    "C10d store has failed. See inner exception for details.",
    "    raise ChildFailedError(",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
]


def test_torchruns_lines_become_events() -> None:
    log = AgentLog()
    got = [ev for ev in map(log.parse, AGENT_LINES) if ev is not None]
    assert [type(ev) for ev in got] == [
        Rendezvousing,
        RendezvousDone,
        WorkerFailed,
        Restarting,
        Restarting,
        RendezvousFailed,
        RendezvousFailed,
        Exhausted,
    ]
    done, failed, workers, joined = got[1], got[2], got[3], got[4]
    assert isinstance(done, RendezvousDone) and done.group_rank == 1
    assert isinstance(failed, WorkerFailed)
    assert (failed.exitcode, failed.local_rank, failed.pid) == (-9, 0, 27872)
    assert isinstance(workers, Restarting) and workers.why == "workers failed"
    assert isinstance(joined, Restarting) and joined.why == "another node joined"
    kinds = [ev.kind for ev in got if isinstance(ev, RendezvousFailed)]
    assert kinds == ["timeout", "connection"]


def test_the_tee_passes_every_byte_on_and_queues_the_events() -> None:
    raw = "".join(line + "\n" for line in AGENT_LINES).encode() + b"no newline at the end"
    out = io.BytesIO()
    tee = AgentTee(io.BytesIO(raw), out)
    tee.join(5.0)
    assert out.getvalue() == raw
    assert len(tee.drain()) == 8 and tee.drain() == []


def policy(**kw: object) -> Policy:
    return Policy(**{"max_restarts": 2, "restart_window_s": 100.0, "backoff_s": 1.0, **kw})  # type: ignore[arg-type]


def test_the_budget_counts_one_restart_per_round_and_every_agent_restart() -> None:
    b = GroupBudget(policy())
    first = b.restart(10.0, "node 1 rank 1: signal 9")
    assert first == NextRestart(1, 1.0)
    assert b.restart(10.5, "another trigger in the same round") is None
    b.new_round()
    assert b.restart(20.0, "node 1 agent: killed by signal 9", agent=True) == NextRestart(2, 2.0)
    b.new_round()
    gave = b.restart(30.0, "node 1 rank 1: exit 1")
    assert isinstance(gave, GiveUp)
    assert gave.detail == (
        "after 2 group restarts: node 1 rank 1: signal 9, node 1 agent: killed by signal 9, "
        "node 1 rank 1: exit 1"
    )
    later = GroupBudget(policy())  # restarts older than the window no longer count
    later.restart(0.0, "a")
    later.new_round()
    later.restart(1.0, "b")
    later.new_round()
    assert later.restart(200.0, "c") == NextRestart(1, 1.0)
    assert isinstance(GroupBudget(policy(restart="never")).restart(0.0, "x"), GiveUp)


NODE = GroupNode(1, 2, 1, "10.0.0.1", 29400, 60.0)


@pytest.mark.parametrize(
    ("life", "verdict", "why"),
    [
        (AgentLife(returncode=1, operator_stop=True), "stopped", "stopped by the operator"),
        (AgentLife(returncode=0, trainer_state="finished"), "finished", "the trainer finished"),
        (AgentLife(returncode=0, trainer_state="stopped"), "stopped", "the trainer was stopped"),
        (
            AgentLife(returncode=1, no_restart="node 1 rank 1 exit 2: ..."),
            "not-restarted",
            "node 1",
        ),
        (
            AgentLife(returncode=1, rendezvous="timeout"),
            "not-restarted",
            "the rendezvous timed out: not all 2 nodes joined within 60 s",
        ),
        (AgentLife(returncode=1, rendezvous="closed"), "failure", "its rendezvous failed (closed)"),
        (AgentLife(returncode=1, exhausted=True), "failure", "torchrun spent its --max-restarts"),
        (AgentLife(returncode=-9), "failure", "killed by signal 9"),
        (AgentLife(returncode=0), "failure", "exited (exit 0)"),
        (
            AgentLife(returncode=1, errors=["stage drafter failed: NonFiniteLoss: ..."]),
            "not-restarted",
            "non-finite divergence",
        ),
    ],
)
def test_what_an_agents_ending_means(life: AgentLife, verdict: str, why: str) -> None:
    got = agent_verdict(life, policy(), NODE)
    assert got[0] == verdict and got[1].startswith(why), got


def test_exits_that_must_not_be_restarted() -> None:
    p = policy(no_restart_exit_codes=frozenset({2, 7}))
    assert worker_no_restart(2, None, p) == "exit 2 is in no_restart_exit_codes"
    assert worker_no_restart(1, 7, p) == "exit 7 is in no_restart_exit_codes"
    assert worker_no_restart(3, None, p) is not None and "checkpoints kept failing" in str(
        worker_no_restart(3, None, p)
    )
    assert worker_no_restart(-9, None, p) is None and worker_no_restart(1, 1, p) is None


def test_the_nodes_place_comes_from_the_torchrun_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["py", "-m", "torch.distributed.run", "--nnodes", "3", "--nproc-per-node", "4"]
    argv += ["--rdzv-endpoint", "[2001:db8::1]:29400", "--rdzv-conf"]
    argv += ["is_host=false,join_timeout=90", "-m", "trainer"]
    monkeypatch.setenv("DFLASH_RANK_BASE", "4")
    node = group_node_of(argv, 1)
    assert (node.nnodes, node.nproc, node.host, node.port) == (3, 4, "[2001:db8::1]", 29400)
    assert node.rendezvous_timeout_s == 90.0 and node.global_rank(2) == 6
    with pytest.raises(ValueError, match="--group-node 3: not a node of --nnodes 3"):
        group_node_of(argv, 3)
    with pytest.raises(ValueError, match="no --rdzv-endpoint"):
        group_node_of(argv[:7], 0)


def test_the_launch_rank_follows_the_inventory_not_torchrun() -> None:
    env = {"RANK": "0", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert launch_rank(env) == 0  # not a group: torchrun's
    assert launch_rank({**env, "DFLASH_NODE_RANK": "1"}) == 3  # node 1 x 2 + 1
    assert launch_rank({**env, "DFLASH_NODE_RANK": "1", "DFLASH_RANK_BASE": "5"}) == 6


def test_fresh_and_an_explicit_resume_apply_once_per_launch(tmp_path: Path) -> None:
    env = {"DFLASH_LAUNCH_ID": "g-1"}
    assert not repeated_launch(tmp_path, env)
    mark_launch(tmp_path, env)
    assert repeated_launch(tmp_path, env)  # torchrun's restart of the same launch
    assert not repeated_launch(tmp_path, {"DFLASH_LAUNCH_ID": "g-2"})  # the next start
    assert not repeated_launch(tmp_path, {})  # not a group launch: always as given
    assert not [p for p in tmp_path.iterdir() if p.name != ".launch-id"]
