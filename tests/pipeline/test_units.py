"""Pipeline building blocks: LR schedule, channels, reorder buffer, plan, checkpoints, rates."""

from __future__ import annotations

import itertools
import json
import queue
import random
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainer.config.schedule import lr_at, warmup_steps_for
from trainer.events.checkpoint_layout import REQUIRED_KEYS
from trainer.pipeline.channels import ReorderBuffer, Stopped, WaitClock, get, put
from trainer.pipeline.checkpoint import (
    CheckpointError,
    CheckpointWriteError,
    archive_checkpoints,
    list_checkpoints,
    load_checkpoint,
    reject_checkpoint,
    save_checkpoint,
    select_resume,
)
from trainer.pipeline.plan import BatchPlan
from trainer.pipeline.status import RateWindow, RunStateFile, bottleneck
from trainer.sampler import BatchSampler


def test_step_zero_trains_with_warmup_lr_not_peak() -> None:
    """The seed printed the peak LR at step 0; here step 0 gets peak/W and warmup is linear."""
    kw: dict[str, Any] = {"total_steps": 1000, "warmup_steps": 40, "peak": 6e-4, "floor": 6e-5}
    assert lr_at(0, **kw) == pytest.approx(6e-4 / 40)
    warm = [lr_at(s, **kw) for s in range(40)]
    assert all(a < b for a, b in itertools.pairwise(warm))
    assert lr_at(39, **kw) == pytest.approx(6e-4)
    decay = [lr_at(s, **kw) for s in range(40, 1000)]
    assert all(a >= b for a, b in itertools.pairwise(decay))
    assert lr_at(999, **kw) == pytest.approx(6e-5, rel=1e-3)
    assert lr_at(5000, **kw) == pytest.approx(6e-5)


def test_warmup_steps_from_ratio_or_explicit() -> None:
    """Explicit warmup steps win over the ratio; a tiny ratio still warms up for one step."""
    assert warmup_steps_for(1000, None, 0.04) == 40
    assert warmup_steps_for(1000, 7, 0.04) == 7
    assert warmup_steps_for(10, None, 0.001) == 1
    assert warmup_steps_for(10, None, None) == 0


def test_reorder_buffer_releases_in_sequence_order() -> None:
    """Items put out of order by many threads come out strictly by sequence number."""
    buf: ReorderBuffer[int] = ReorderBuffer(capacity=3)
    stop = threading.Event()
    seqs = list(range(200))
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not seqs:
                    return
                seq = seqs.pop(0)
            threading.Event().wait(random.random() * 0.002)
            buf.put(seq, seq * 10, stop)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    got = [buf.get(stop) for _ in range(200)]
    for t in threads:
        t.join(5)
    assert got == [(i, i * 10) for i in range(200)]


def test_reorder_buffer_applies_backpressure_and_unblocks_on_stop() -> None:
    """A put too far ahead blocks (bounded memory) until stop is set, then raises Stopped."""
    buf: ReorderBuffer[str] = ReorderBuffer(capacity=2)
    stop = threading.Event()
    buf.put(1, "b", stop)
    errors: list[BaseException] = []

    def far_ahead() -> None:
        try:
            buf.put(2, "c", stop)  # 2 >= next(0) + capacity(2): must wait
        except Stopped as exc:
            errors.append(exc)

    t = threading.Thread(target=far_ahead)
    t.start()
    t.join(0.3)
    assert t.is_alive() and buf.depth() == 1
    stop.set()
    t.join(2)
    assert not t.is_alive() and len(errors) == 1
    with pytest.raises(Stopped):
        buf.get(stop)


def test_reorder_buffer_rejects_duplicates() -> None:
    """Delivering a sequence number twice is a bug upstream, never silently merged."""
    buf: ReorderBuffer[int] = ReorderBuffer(capacity=4)
    stop = threading.Event()
    buf.put(0, 1, stop)
    with pytest.raises(RuntimeError, match="twice"):
        buf.put(0, 2, stop)


def test_queue_ops_count_blocked_time_and_honour_stop() -> None:
    """put/get on a full/empty queue record their wait and raise Stopped when stopped."""
    q: queue.Queue[int] = queue.Queue(maxsize=1)
    stop = threading.Event()
    clock = WaitClock()
    put(q, 1, stop, clock)
    timer = threading.Timer(0.2, stop.set)
    timer.start()
    with pytest.raises(Stopped):
        put(q, 2, stop, clock)
    assert clock.output_s >= 0.15
    assert get(q, threading.Event(), clock) == 1


def test_plan_numbers_the_samplers_batches_in_order() -> None:
    """seq -> batch follows the sampler's own iteration across epochs; totals add up."""
    rng = np.random.default_rng(0)
    lengths = rng.integers(8, 64, size=300)
    sampler = BatchSampler(
        lengths, boundaries=[8, 24, 40, 64], token_budget=256, max_batch=8, seed=3
    )
    plan = BatchPlan(sampler, epochs=2.5)
    spe = [sampler.steps_per_epoch(e) for e in range(3)]
    assert plan.total == spe[0] + spe[1] + spe[2] // 2
    fresh = BatchSampler(lengths, boundaries=[8, 24, 40, 64], token_budget=256, max_batch=8, seed=3)
    it = iter([b for e in range(3) for b in fresh.epoch_batches(e)])
    for seq in range(plan.total):
        expected = next(it)
        assert np.array_equal(plan.batch(seq).indices, expected.indices)
    assert plan.real_tokens_before(spe[0]) == int(lengths.sum())
    assert plan.epoch_progress(spe[0]) == pytest.approx(1.0)


def _state(value: float) -> dict[str, object]:
    """A checkpoint-shaped state: every required key, a drafter and an optimizer tensor."""
    state: dict[str, object] = {k: {} for k in REQUIRED_KEYS}
    state["drafter"] = {"fc.weight": torch.full((2,), value)}
    state["optimizer"] = {"state": {0: {"exp_avg": torch.zeros(2)}}, "param_groups": []}
    state["w"] = torch.full((2,), value)
    return state


def test_checkpoints_are_atomic_pruned_and_archived(tmp_path: Path) -> None:
    """Only complete files count; the newest N are kept; --fresh moves them aside intact."""
    for step in (10, 20, 30, 40):
        save_checkpoint(tmp_path, step, _state(float(step)), keep_last=2)
    (tmp_path / "checkpoints" / ".step-00000050.pt.tmp-1").write_bytes(b"partial")
    assert [s for s, _ in list_checkpoints(tmp_path)] == [30, 40]
    state = load_checkpoint(list_checkpoints(tmp_path)[-1][1])
    assert torch.equal(state["w"], torch.full((2,), 40.0))
    dest = archive_checkpoints(tmp_path)
    assert dest is not None and dest.name.startswith("checkpoints.old-")
    assert sorted(p.name for p in dest.iterdir() if p.suffix == ".pt") == [
        "step-00000030.pt",
        "step-00000040.pt",
    ]
    assert list_checkpoints(tmp_path) == []


def test_damaged_checkpoint_is_a_one_line_error(tmp_path: Path) -> None:
    """A truncated or foreign file names itself instead of crashing in torch.load."""
    bad = tmp_path / "step-00000001.pt"
    bad.write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match=r"step-00000001.pt: cannot load checkpoint") as info:
        load_checkpoint(bad)
    assert "\n" not in str(info.value)


def test_non_finite_state_is_never_written_and_never_resumed(tmp_path: Path) -> None:
    """inf/NaN in the drafter or the AdamW moments: no file, the earlier ones stay."""
    save_checkpoint(tmp_path, 10, _state(1.0), keep_last=1)
    bad = _state(float("nan"))
    with pytest.raises(CheckpointWriteError) as info:
        save_checkpoint(tmp_path, 20, bad, keep_last=1)
    assert str(info.value) == (
        f"checkpoint step=20 not written to {tmp_path / 'checkpoints'}: non-finite values in "
        "drafter.fc.weight; kept step-00000010.pt"
    )
    assert info.value.failed.step == 20
    moments = _state(1.0)
    moments["optimizer"]["state"][0]["exp_avg"][1] = float("inf")  # type: ignore[index]
    with pytest.raises(CheckpointWriteError, match=r"optimizer.state.0.exp_avg; kept step-0+10"):
        save_checkpoint(tmp_path, 30, moments, keep_last=1)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [10]  # keep_last=1 pruned nothing
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000010.pt"]
    # One written by an older trainer is refused on load, and resume selection passes it by.
    torch.save({"version": 1, **bad}, tmp_path / "checkpoints" / "step-00000020.pt")
    with pytest.raises(CheckpointError, match=r"step-00000020.pt: non-finite values in drafter"):
        load_checkpoint(tmp_path / "checkpoints" / "step-00000020.pt")
    sel = select_resume(tmp_path)
    assert sel.path is not None and sel.path.name == "step-00000010.pt"
    assert [(k.path.name, k.reason) for k in sel.skipped] == [
        ("step-00000020.pt", "non-finite values in drafter.fc.weight")
    ]


def test_incomplete_and_rejected_checkpoints(tmp_path: Path) -> None:
    """A file missing keys is refused by name; rejecting moves it aside with its reason."""
    root = tmp_path / "checkpoints"
    root.mkdir()
    partial = _state(1.0)
    del partial["optimizer"], partial["rng"]
    torch.save({"version": 1, **partial}, root / "step-00000005.pt")
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(root / "step-00000005.pt")
    assert info.value.reason == "incomplete checkpoint: missing optimizer, rng"
    assert select_resume(tmp_path).path is None
    for n in range(2):
        (root / "step-00000005.pt").write_bytes(b"x" * n)
        dest = reject_checkpoint(root / "step-00000005.pt", "truncated")
        assert dest.read_bytes() == b"x" * n
        assert dest.with_name(dest.name + ".why").read_text() == "truncated\n"
    assert sorted(p.name for p in (root / "rejected").iterdir()) == [
        "step-00000005.pt",
        "step-00000005.pt.1",
        "step-00000005.pt.1.why",
        "step-00000005.pt.why",
    ]
    assert list_checkpoints(tmp_path) == []


@pytest.mark.parametrize("corrupt", ["{not json", "[1, 2]", '"running"', ""])
def test_a_corrupted_run_state_is_reported_and_rewritten_whole(
    tmp_path: Path, corrupt: str
) -> None:
    """Every field the trainer owns comes back; keys other writers own are kept when readable."""
    rs = RunStateFile(tmp_path)
    assert rs.update(pid=7, config_hash="abc", release="r1", state="running") == []
    (tmp_path / "run-state.json").write_text(corrupt)
    problems = rs.update(last_step=3)
    assert len(problems) == 1 and problems[0].startswith(f"{tmp_path / 'run-state.json'}: not")
    assert problems[0].endswith("; rewritten whole")
    state = json.loads((tmp_path / "run-state.json").read_text())
    assert {k: state[k] for k in ("pid", "config_hash", "release", "state", "last_step")} == {
        "pid": 7,
        "config_hash": "abc",
        "release": "r1",
        "state": "running",
        "last_step": 3,
    }
    data = json.loads((tmp_path / "run-state.json").read_text())
    (tmp_path / "run-state.json").write_text(json.dumps({**data, "restarts": [1]}))
    assert rs.update(state="stopped") == []
    assert json.loads((tmp_path / "run-state.json").read_text())["restarts"] == [1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_rate_window_and_bottleneck_rule() -> None:
    """Rates use the oldest sample inside the window; the bottleneck follows the waits."""
    w = RateWindow(10.0)
    assert w.add(0.0, 0) is None
    assert w.add(5.0, 50) == pytest.approx(10.0)
    assert w.add(20.0, 350) == pytest.approx(20.0)  # only (5, 50) .. (20, 350) remain
    assert bottleneck(w_tgt_in=0.0, w_tgt_out=90.0, w_dft_in=1.0) == "drafter"
    assert bottleneck(w_tgt_in=1.0, w_tgt_out=0.0, w_dft_in=80.0) == "target"
    assert bottleneck(w_tgt_in=90.0, w_tgt_out=0.0, w_dft_in=80.0) == "prefetch"


# --- typed contracts of the loop --------------------------------------------------------------


def test_the_step_reduce_unpacks_by_name_what_each_rank_packed() -> None:
    """Two ranks' contributions, summed as the all-reduce sums them, read back by field."""
    from trainer.pipeline.distributed import World
    from trainer.pipeline.reduce import METRIC_KEYS, StepContribution, StepFlags, StepTotals

    def mine(rank: int, flags: StepFlags, depth: int) -> torch.Tensor:
        metrics = torch.arange(len(METRIC_KEYS), dtype=torch.float64) + rank
        buckets = torch.tensor([1.0, 2.0, 3.0, 4.0], dtype=torch.float64) * (rank + 1)
        return StepContribution(metrics, buckets, flags, depth).pack(World(rank=rank, size=2))

    summed = mine(0, StepFlags(stop=True), 3) + mine(1, StepFlags(eval_due=True), 5)
    totals = StepTotals.unpack(summed.tolist(), world_size=2, num_buckets=2)
    assert totals.flags == StepFlags(stop=True, checkpoint_due=False, eval_due=True)
    assert totals.depths == [3, 5]
    assert totals.bucket_sums == [(3.0, 6.0), (9.0, 12.0)]
    assert totals.metrics == {k: 2.0 * i + 1 for i, k in enumerate(METRIC_KEYS)}
    assert (totals.loss_sum, totals.weight_sum) == (1.0, 3.0)
    with pytest.raises(ValueError, match="short"):
        StepTotals.unpack(summed.tolist()[:-1], world_size=2, num_buckets=2)


def test_run_state_updates_are_checked_against_the_contract(tmp_path: Path) -> None:
    """The one writer refuses a key RunState does not name and a value of the wrong type,
    before anything is written."""
    rs = RunStateFile(tmp_path)
    with pytest.raises(ValueError, match="not a RunState field: totl_steps"):
        rs.update(totl_steps=3)
    with pytest.raises(ValueError, match="state"):
        rs.update(state="exploded")
    assert not (tmp_path / "run-state.json").exists()
    assert rs.update(state="running", total_steps=3, boundaries=[1, 5]) == []
    data = json.loads((tmp_path / "run-state.json").read_text())
    assert (data["state"], data["total_steps"], data["boundaries"]) == ("running", 3, [1, 5])


def test_the_plan_end_resumes_inside_a_fractional_epoch_when_the_run_is_extended() -> None:
    """A checkpoint at the end of a 1.5-epoch plan resumes a 2-epoch plan mid-epoch 1."""
    lengths = np.random.default_rng(4).integers(8, 64, size=200)
    kw: dict[str, Any] = dict(boundaries=[8, 30, 64], token_budget=256, max_batch=8, seed=1)
    short, long = (
        BatchPlan(BatchSampler(lengths, **kw), 1.5),
        BatchPlan(BatchSampler(lengths, **kw), 2),
    )
    state = json.loads(json.dumps(short.state_dict(short.total)))
    seq = long.load_state_dict(state)
    assert seq == short.total < long.total
    assert (
        long.batch(seq).indices.tolist()
        == long.sampler.epoch_batches(1)[short.steps[1]].indices.tolist()
    )
