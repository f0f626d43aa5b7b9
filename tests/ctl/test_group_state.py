"""The group's state from its nodes' reports (dflashctl.groups.state.group_state, pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dflashctl.config.inventory import GroupConfig, parse_inventory
from dflashctl.config.runconfig import config_hash_of_file
from dflashctl.errors import UsageError
from dflashctl.groups.control import GroupControl, group_config_path
from dflashctl.groups.starter import failed_node, shared_deployment
from dflashctl.groups.state import NodeReport, group_json, group_state, torchrun_failure
from dflashctl.remote.transport import LocalTransport
from dflashctl.runs.service import ControlError
from dflashctl.runs.snapshot import RunStatus
from tests.ctl.parts import REPO, halve_lr
from trainer.events.run_state import RunState

# torchrun's report in the dead pane of a node whose worker was SIGKILLed (torch 2.x layout)
KILLED_TAIL = (
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:",
    "============================================================",
    "trainer FAILED",
    "------------------------------------------------------------",
    "Failures:",
    "  <NO_OTHER_FAILURES>",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  time      : 2026-12-01_13:45:00",
    "  host      : n1",
    "  rank      : 1 (local_rank: 0)",
    "  exitcode  : -9 (pid: 4321)",
    "  error_file: <N/A>",
    "  traceback : Signal 9 (SIGKILL) received by PID 4321",
    "============================================================",
)
# torchrun lists the other failed ranks under "Failures:" before the root cause
OTHERS_FIRST_TAIL = (
    "Failures:",
    "[1]:",
    "  rank      : 1 (local_rank: 1)",
    "  exitcode  : 1 (pid: 14989)",
    "------------------------------------------------------------",
    "Root Cause (first observed failure):",
    "[0]:",
    "  rank      : 0 (local_rank: 0)",
    "  exitcode  : -9 (pid: 14988)",
)
PEER_TAIL = tuple(
    line.replace("rank      : 1", "rank      : 0").replace("exitcode  : -9", "exitcode  : 1")
    for line in KILLED_TAIL
)


def node(
    host: str,
    rank: int,
    state: str,
    *,
    exit_status: int | None = None,
    finished: bool = False,
    step: int | None = None,
    run_state: RunState | None = None,
    pane_tail: tuple[str, ...] = (),
) -> NodeReport:
    return NodeReport(
        host=host,
        node_rank=rank,
        state=state,
        exit_status=exit_status,
        finished=finished,
        step=step,
        run_state=run_state or RunState(rank_range=[rank, rank + 1]),
        pane_tail=pane_tail,
    )


def test_all_running_is_running_and_step_is_node_0s() -> None:
    v = group_state(
        "g",
        [node("n1", 1, "running", step=7), node("n0", 0, "running", step=8)],
    )
    assert v.state == "running" and v.failed is None
    assert [n.host for n in v.nodes] == ["n0", "n1"]  # node order, whatever the input order
    assert v.step == 8


def test_one_node_unreachable_is_degraded_never_crashed() -> None:
    v = group_state("g", [node("n0", 0, "running"), node("n1", 1, "unreachable")])
    assert v.state == "degraded" and v.failed is None
    assert v.unreachable == ("n1",)
    assert v.summary() == (
        "g: degraded: n1 unreachable (state unknown); the group may still train "
        "(1 reachable node(s) run)"
    )
    assert group_state("g", [node("n0", 0, "unreachable")] * 1).state == "unreachable"


def test_killed_node_is_named_with_its_rank_not_the_peer_that_lost_it() -> None:
    peer_rs = RunState(state="crashed", rank_range=[0, 1], exit_status=1)
    v = group_state(
        "g",
        [
            node("n0", 0, "crashed", exit_status=1, run_state=peer_rs, pane_tail=PEER_TAIL),
            node("n1", 1, "crashed", exit_status=1, pane_tail=KILLED_TAIL),
        ],
    )
    assert v.state == "failed"
    assert v.failed is not None and (v.failed.host, v.failed.node_rank, v.failed.rank) == (
        "n1",
        1,
        1,
    )
    assert "killed by signal 9" in v.summary()
    assert group_json(v)["failed"] == {"host": "n1", "node_rank": 1, "rank": 1}


def test_without_torchruns_report_the_node_without_a_record_failed_first() -> None:
    peer_rs = RunState(state="crashed", rank_range=[0, 1])
    killed_rs = RunState(state="running", rank_range=[1, 2])
    v = group_state(
        "g",
        [
            node("n0", 0, "crashed", exit_status=1, run_state=peer_rs),
            node("n1", 1, "crashed", exit_status=1, run_state=killed_rs),
        ],
    )
    assert v.failed is not None and (v.failed.host, v.failed.rank) == ("n1", 1)


def test_a_recorded_failed_rank_wins_and_names_its_node() -> None:
    rs0 = RunState(state="crashed", rank_range=[0, 2], failed_rank=3)
    rs1 = RunState(state="crashed", rank_range=[2, 4])
    v = group_state(
        "g",
        [node("n0", 0, "crashed", run_state=rs0), node("n1", 1, "crashed", run_state=rs1)],
    )
    assert v.failed is not None and (v.failed.host, v.failed.node_rank, v.failed.rank) == (
        "n1",
        1,
        3,
    )


def test_first_in_node_order_when_nothing_else_tells_and_rank_unknown_for_many() -> None:
    rs = RunState(state="crashed", rank_range=[0, 2])
    rs1 = RunState(state="crashed", rank_range=[2, 4])
    v = group_state(
        "g",
        [
            node("n0", 0, "crashed", exit_status=1, run_state=rs),
            node("n1", 1, "crashed", exit_status=1, run_state=rs1),
        ],
    )
    assert v.failed is not None and (v.failed.host, v.failed.rank) == ("n0", None)
    assert "rank unknown" in v.summary()


def test_a_failed_node_fails_the_group_while_others_still_run_or_are_unreachable() -> None:
    v = group_state(
        "g",
        [node("n0", 0, "running"), node("n1", 1, "gave-up"), node("n2", 2, "unreachable")],
    )
    assert v.state == "failed" and v.failed is not None and v.failed.host == "n1"


def test_stopped_finished_partial() -> None:
    assert group_state("g", [node("a", 0, "stopped"), node("b", 1, "stopped")]).state == "stopped"
    fin = [node("a", 0, "stopped", finished=True), node("b", 1, "stopped", finished=True)]
    assert group_state("g", fin).state == "finished"
    mixed = [node("a", 0, "stopped", finished=True), node("b", 1, "stopped")]
    assert group_state("g", mixed).state == "stopped"
    part = group_state("g", [node("a", 0, "running"), node("b", 1, "stopped")])
    assert part.state == "partial"
    assert part.summary() == "g: partial: running on a; not on b"


def test_from_status_takes_the_nodes_own_step_else_the_status_lines() -> None:
    st = RunStatus(host="n1", state="running", run_state=RunState(step=5, rank_range=[1, 2]))
    rep = NodeReport.from_status(st, 1)
    assert (rep.step, rep.rank_range, rep.node_rank) == (5, (1, 2), 1)
    assert NodeReport.from_status(RunStatus(host="n0", state="stopped"), 0).step is None
    js = group_json(group_state("g", [rep]))
    assert js["nodes"][0]["rank_range"] == [1, 2] and js["nodes"][0]["step"] == 5


def test_torchrun_failure_parser() -> None:
    assert torchrun_failure(KILLED_TAIL) == (1, -9)
    assert torchrun_failure(PEER_TAIL) == (0, 1)
    assert torchrun_failure(("Traceback", "ValueError: x")) is None
    assert torchrun_failure(OTHERS_FIRST_TAIL) == (0, -9)


# --- the refusals a group command makes before touching a node ----------------------------


def _pair(tmp_path: Path, cfg0: Path | None, cfg1: Path | None) -> GroupConfig:
    lines = []
    for i, cfg in enumerate((cfg0, cfg1)):
        lines += [f"[hosts.n{i}]", f'address = "p{i}"', f"ctid = {200 + i}"]
        lines += [f'node_address = "192.0.2.{10 + i}"']
        if cfg is not None:
            lines.append(f'run_config = "{cfg}"')
    lines += ["[groups.g]", 'hosts = ["n0", "n1"]']
    return parse_inventory("\n".join(lines) + "\n", tmp_path / "hosts.toml").groups["g"]


def test_one_config_per_group_or_a_refusal_naming_nodes_and_hashes(tmp_path: Path) -> None:
    tiny = (REPO / "configs" / "tiny-cpu.toml").read_text()
    a, b, c = tmp_path / "a.toml", tmp_path / "b.toml", tmp_path / "c.toml"
    a.write_text(tiny)
    b.write_text(tiny)  # the same config in another file: fine
    c.write_text(halve_lr(tiny)[0])
    assert group_config_path(_pair(tmp_path, a, b), None) == a
    assert group_config_path(_pair(tmp_path, a, c), b) == b  # --config wins
    with pytest.raises(UsageError) as err:
        group_config_path(_pair(tmp_path, a, c), None)
    ha, hc = config_hash_of_file(a), config_hash_of_file(c)
    assert str(err.value) == (
        f"group 'g': the nodes' run_config differ (n0 {ha}, n1 {hc}); give them one file, "
        f"or pass --config PATH"
    )


def test_start_refuses_nodes_with_another_release_or_nothing_deployed(tmp_path: Path) -> None:
    group = _pair(tmp_path, None, None)
    gc = GroupControl(group, [LocalTransport(), LocalTransport()])
    same = [
        RunStatus(host=h, state="stopped", release="r1", deployed_config_hash="c1")
        for h in ("n0", "n1")
    ]
    assert shared_deployment(gc.name, same) == ("r1", "c1")
    other = [
        same[0],
        RunStatus(host="n1", state="stopped", release="r2", deployed_config_hash="c1"),
    ]
    with pytest.raises(ControlError, match=r"the nodes' releases differ \(n0 r1, n1 r2\)"):
        shared_deployment(gc.name, other)
    bare = [same[0], RunStatus(host="n1", state="stopped")]
    with pytest.raises(ControlError, match="nothing deployed on n1; run `dflashctl deploy g`"):
        shared_deployment(gc.name, bare)
    with pytest.raises(ValueError, match="1 transports, 2 nodes"):
        GroupControl(group, [LocalTransport()])


def test_a_failed_group_start_is_named_by_the_node_that_failed_first() -> None:
    """The node a failed start names: the failed one (its report) before the first that merely
    ended, and node 0 when every node still runs (the group restarted meanwhile)."""

    def nodes(*states: str) -> list[RunStatus]:
        return [RunStatus(host=f"n{i}", state=s) for i, s in enumerate(states)]

    assert failed_node("g", nodes("running", "running")) == 0
    assert failed_node("g", nodes("running", "stopped")) == 1
    assert failed_node("g", nodes("stopped", "crashed")) == 1  # not node 0, which ended first
    assert failed_node("g", nodes("stopped", "stopped")) == 0


def test_the_group_names_node_0s_checkpoint_and_no_other_nodes() -> None:
    """Only node 0 writes checkpoints: the group's checkpoint is its newest (JSON and one
    line), node 1's run-state names none and says where they are."""
    path = "/wd/run/checkpoints/step-00000040.pt"
    rs0 = RunState(rank_range=[0, 1], node_rank=0, checkpoint_node=0, last_step=40)
    rs0 = rs0.model_copy(update={"last_checkpoint": path})
    rs1 = RunState(rank_range=[1, 2], node_rank=1, checkpoint_node=0)
    assert rs1.checkpoints_elsewhere == 0 and rs0.checkpoints_elsewhere is None
    v = group_state(
        "g", [node("n1", 1, "running", run_state=rs1), node("n0", 0, "running", run_state=rs0)]
    )
    assert group_json(v)["checkpoint"] == {"host": "n0", "node_rank": 0, "step": 40, "path": path}
    assert v.checkpoint_line() == f"checkpoints on node 0 (n0): step 40 {path}"
    fresh = group_state("g", [node("n0", 0, "running"), node("n1", 1, "running")])
    assert fresh.checkpoint_line() == "checkpoints on node 0 (n0): none recorded yet"
    assert group_state("g", []).checkpoint_json() is None


def test_status_text_names_the_writer_node_on_the_group_and_on_node_1(tmp_path: Path) -> None:
    """`dflashctl status GROUP` (text): the group's checkpoint line under its summary, and node
    1's own status says its checkpoints are on node 0 instead of naming none."""
    from dflashctl.cli.status import group_entry
    from dflashctl.cli.status_text import format_run_status

    path = "/wd/run/checkpoints/step-00000040.pt"
    rs0 = RunState(rank_range=[0, 1], node_rank=0, checkpoint_node=0, last_step=40)
    rs0 = rs0.model_copy(update={"last_checkpoint": path})
    rs1 = RunState(rank_range=[1, 2], node_rank=1, checkpoint_node=0)
    st0 = RunStatus(host="n0", state="running", run_state=rs0)
    st1 = RunStatus(host="n1", state="running", run_state=rs1)
    assert "checkpoints: on node 0 (this node writes none)" in format_run_status(st1)
    assert "checkpoints: on node" not in format_run_status(st0)
    text = group_entry(_pair(tmp_path, None, None), [st0, st1], as_json=False)
    assert isinstance(text, str)
    assert text.splitlines()[1] == f"  checkpoints on node 0 (n0): step 40 {path}"


def test_a_node_that_died_without_an_error_line_is_described_never_by_a_banner() -> None:
    """A dead pane whose last lines are torchrun's report and its `=====` rule: the error line
    is torchrun's root cause in words; other panes give their last line that says something."""
    from dflashctl.runs.snapshot import last_error_line

    assert last_error_line("", "\n".join(KILLED_TAIL)) == (
        "torchrun: rank 1 was killed by SIGKILL (exit status 137) (no error line of its own)"
    )
    assert last_error_line("", "\n".join(PEER_TAIL)).startswith(  # type: ignore[union-attr]
        "torchrun: rank 0 exited with status 1 (failed)"
    )
    assert last_error_line("", "boom\n=====\n-----\nPane is dead (status 1)\n") == "boom"
    refused = "ERROR: rank 1: data.store: /data/store: no such token store directory"
    assert last_error_line("", "\n".join([refused, *KILLED_TAIL])) == refused[len("ERROR: ") :]


def test_a_refused_node_is_named_first_with_its_own_line_not_node_0() -> None:
    """Node 1 refused (its run-state says so, with its reason); node 0 crashed after it (its
    collective broke) without knowing who: the group blames node 1, in node 1's words."""
    why = "rank 1: data.store: /data/store: no such token store directory"
    rs1 = RunState(rank_range=[1, 2], state="refused", exit_status=2, last_error=why)
    rs0 = RunState(rank_range=[0, 1], state="crashed", exit_status=1, last_error="stage failed")
    v = group_state(
        "g",
        [
            node("n0", 0, "crashed", exit_status=1, run_state=rs0, pane_tail=PEER_TAIL),
            node("n1", 1, "crashed", exit_status=1, run_state=rs1),
        ],
    )
    assert v.failed is not None and (v.failed.host, v.failed.rank, v.failed.error) == (
        "n1",
        1,
        why,
    )
    assert (
        v.summary()
        == f"g: failed: node 1 (n1) rank 1 failed first (its trainer refused to start): {why}"
    )


def test_the_data_preflight_names_each_node_and_path_it_lacks() -> None:
    """Relative paths resolve against the config's directory on the node; what the trainer
    builds itself (synthetic store, tiny target) is never a problem; one line per gap."""
    from dflashctl.config.runconfig import load_config_text
    from dflashctl.groups.preflight import check_argv, data_needs, problems

    tiny = load_config_text((REPO / "configs" / "tiny-cpu.toml").read_text())
    built = data_needs(tiny, "/srv/dflash1/run")
    assert [(n.key, n.path, n.built) for n in built] == [
        ("data.store", "/srv/dflash1/run/.cache/tiny-store", True),
        ("model.target_dir", "/srv/dflash1/run/.cache/tiny-qwen3", True),
    ]
    assert problems("n1", built, "no\nno\n") == []
    real = tiny.model_copy(
        update={
            "data": tiny.data.model_copy(update={"store": "/data/store", "synthetic": None}),
            "model": tiny.model.model_copy(update={"target_dir": "../t", "tiny_target": None}),
        }
    )
    needs = data_needs(real, "/srv/dflash1/run")
    assert check_argv(needs)[-2:] == ["/data/store/manifest.json", "/srv/dflash1/t/config.json"]
    assert problems("n1", needs, "yes\nyes\n") == []
    assert problems("n1", needs, "no\nyes\n") == [
        "n1: data.store /data/store: no token store there (no manifest.json); every node reads "
        "its own copy: put it at that path on n1"
    ]
    assert len(problems("n1", needs, "")) == 2  # no answer: nothing is assumed to be there


# --- supervised groups: every node's supervisor records, side by side -----------------------


def sup_node(
    host: str,
    rank: int,
    state: str,
    sup_state: str,
    *,
    failures: list[dict[str, object]] = (),  # type: ignore[assignment]
    restarts: list[dict[str, object]] = (),  # type: ignore[assignment]
    detail: str | None = None,
    attempt: int = 1,
) -> NodeReport:
    return NodeReport(
        host=host,
        node_rank=rank,
        state=state,
        run_state=RunState(rank_range=[rank, rank + 1]),
        supervisor={
            "state": sup_state,
            "detail": detail,
            "attempt": attempt,
            "failures": list(failures),
            "restarts": list(restarts),
        },
    )


def fail(
    attempt: int, rank: int, reason: str, *, at: str, peer: bool = False, **kw: object
) -> dict[str, object]:
    return {
        "attempt": attempt,
        "kind": "rank",
        "node_rank": rank,
        "rank": rank,
        "reason": reason,
        "at": at,
        "peer": peer,
        **kw,
    }


def test_a_restarted_group_names_each_attempts_first_failure_from_every_nodes_records() -> None:
    """Node 0's rank failed too (its peer died), a moment later: node 1's signal 9 is the
    cause; node 0 counted the restart, both trained again (attempt 2): running, one restart."""
    n0 = sup_node(
        "n0",
        0,
        "running",
        "running",
        attempt=2,
        failures=[fail(1, 0, "exit 1", at="2026-12-01T10:00:01Z", peer=True)],
        restarts=[{"attempt": 2, "kind": "workers", "resumed_at": "2026-12-01T10:00:09Z"}],
    )
    n1 = sup_node(
        "n1",
        1,
        "running",
        "running",
        attempt=2,
        failures=[fail(1, 1, "signal 9", at="2026-12-01T10:00:02Z", signal=9)],
        restarts=[{"attempt": 2, "kind": "workers", "resumed_at": "2026-12-01T10:00:09Z"}],
    )
    v = group_state("g", [n0, n1])
    assert v.state == "running" and v.attempt == 2
    (a,) = v.history
    assert (a.number, a.first.host, a.first.rank, a.first.reason) == (1, "n1", 1, "signal 9")
    assert a.restarted and a.resumed
    js = group_json(v)
    assert js["restarts"] == [
        {
            "attempt": 1,
            "host": "n1",
            "node_rank": 1,
            "rank": 1,
            "reason": "signal 9",
            "error": None,
            "restarted": True,
            "resumed": True,
        }
    ]


def test_restarting_and_the_rendezvous_say_how_many_nodes_are_there() -> None:
    waiting = sup_node(
        "n0",
        0,
        "rendezvous",
        "rendezvous",
        failures=[fail(1, 0, "exit 1", at="2026-12-01T10:00:01Z", peer=True)],
    )
    backoff = sup_node(
        "n1",
        1,
        "restarting",
        "restarting",
        failures=[
            {
                "attempt": 1,
                "kind": "agent",
                "node_rank": 1,
                "rank": None,
                "reason": "killed by signal 9",
                "at": "2026-12-01T10:00:00Z",
            }
        ],
    )
    v = group_state("g", [waiting, backoff])
    assert v.state == "restarting"
    assert v.summary() == "g: restarting: after attempt 1: node 1 (n1) agent: killed by signal 9"
    back = sup_node("n1", 1, "rendezvous", "rendezvous")
    alone = group_state("g", [waiting, sup_node("n1", 1, "running", "running")])
    assert alone.state == "rendezvous" and alone.waiting == ("n0",)
    assert alone.summary().startswith("g: rendezvous (1/2 nodes): after attempt 1: node 0 (n0)")
    assert alone.summary().endswith("; waiting for n1")
    both = group_state("g", [sup_node("n0", 0, "rendezvous", "rendezvous"), back])
    assert both.summary() == "g: rendezvous (2/2 nodes)"


def test_a_crash_loop_gave_up_once_naming_every_attempt() -> None:
    why = "rank 1: stage drafter failed: InjectedFault: injected fault"
    fails = [fail(k, 1, "exit 1", at=f"2026-12-01T10:0{k}:00Z", error=why) for k in (1, 2, 3)]
    gave = "gave up after 2 group restarts: node 1 rank 1: exit 1, node 1 rank 1: exit 1, node 1 rank 1: exit 1"
    n0 = sup_node("n0", 0, "rendezvous", "rendezvous", attempt=3)
    n1 = sup_node(
        "n1",
        1,
        "gave-up",
        "gave-up",
        failures=fails,
        detail=gave,
        attempt=3,
        restarts=[{"attempt": 2, "resumed_at": "x"}, {"attempt": 3, "resumed_at": "y"}],
    )
    v = group_state("g", [n0, n1])
    assert v.state == "gave-up" and v.verdict == gave
    assert v.failed is not None and (v.failed.host, v.failed.rank, v.failed.error) == ("n1", 1, why)
    line = v.summary()
    assert line.startswith(f"g: gave-up: {gave}; attempt 1: node 1 (n1) rank 1: exit 1: {why}; ")
    assert "attempt 3: node 1 (n1) rank 1: exit 1" in line
    assert [a.restarted for a in v.history] == [True, True, False]


def test_an_exit_that_is_not_restarted_fails_the_group_with_the_nodes_reason() -> None:
    why = (
        "node 1 rank 1 exit 2: exit 2 is in no_restart_exit_codes: rank 1: data.store: /d: no store"
    )
    n1 = sup_node(
        "n1",
        1,
        "crashed",
        "not-restarted",
        detail=why,
        failures=[
            fail(
                1, 1, "exit 2", at="2026-12-01T10:00:00Z", error="rank 1: data.store: /d: no store"
            )
        ],
    )
    v = group_state("g", [sup_node("n0", 0, "rendezvous", "rendezvous"), n1])
    assert v.state == "failed" and v.verdict == why
    assert (
        v.summary()
        == f"g: failed: {why}; attempt 1: node 1 (n1) rank 1: exit 2: rank 1: data.store: /d: no store"
    )
