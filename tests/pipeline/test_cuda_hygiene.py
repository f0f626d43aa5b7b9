"""CUDA hygiene that a CPU run can observe (issue 16, item 4): one host read per optimizer step
in the pipeline's own code, at most two packets staged on the drafter's device, packets kept
where the target made them until the drafter pulls them, and `python -m trainer` setting the
CUDA allocator's `expandable_segments` itself. The CUDA-only paths (streams, events,
`record_stream`, `set_device`, NCCL `device_id`) run under the last test when a GPU is there."""

from __future__ import annotations

import collections
import os
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import trainer.pipeline.runner as runner_mod
import trainer.pipeline.stages as stages_mod
from trainer.pipeline.build import RunOptions
from trainer.pipeline.channels import ReorderBuffer, Stopped, WaitClock
from trainer.pipeline.runner import run
from trainer.pipeline.stages import Packet, Stager
from trainer.pipeline.step import train_step as real_train_step

from .conftest import write_config

PIPELINE = str(Path(runner_mod.__file__).parent)

# Tensor methods that read a device tensor's values on the host (each one waits for the
# device's queued work). `.to("cpu")`'s result is host memory: reading it again is free.
READS = ("item", "tolist", "numpy", "cpu", "__float__", "__int__", "__bool__", "__index__")


class SyncCounter:
    """Counts host reads of tensor values made in the drafter thread inside `train_step`, by
    the file and line that asked for them (the frame calling the tensor method). The step's
    own code must ask once; what the model code and torch's optimizer read (host-resident
    tensors there by design, such as AdamW's step counts) is listed, not asserted."""

    def __init__(self) -> None:
        self.in_step = threading.local()
        self.steps = 0
        self.by_site: collections.Counter[str] = collections.Counter()
        self._host: dict[int, weakref.ref[torch.Tensor]] = {}  # by id: tensors do not hash

    def active(self) -> bool:
        return bool(getattr(self.in_step, "on", False))

    def note(self, t: torch.Tensor) -> None:
        """`t`'s values are read on the host (called from a wrapper: frame 2 asked)."""
        ref = self._host.get(id(t))
        if self.active() and (ref is None or ref() is not t):  # a host copy reads for free
            frame = sys._getframe(2)
            self.by_site[f"{frame.f_code.co_filename}:{frame.f_lineno}"] += 1

    def host(self, t: object) -> None:
        if self.active() and isinstance(t, torch.Tensor):
            self._host[id(t)] = weakref.ref(t)

    def pipeline_sites(self) -> dict[str, int]:
        return {s: n for s, n in self.by_site.items() if s.startswith(PIPELINE)}


@contextmanager
def counting_syncs(monkeypatch: pytest.MonkeyPatch) -> Iterator[SyncCounter]:
    counter = SyncCounter()

    def wrap(name: str) -> Callable[..., object]:
        original = getattr(torch.Tensor, name)

        def read(self: torch.Tensor, *args: object, **kwargs: object) -> object:
            counter.note(self)
            out = original(self, *args, **kwargs)
            if name == "cpu":
                counter.host(out)
            return out

        return read

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, wrap(name))
    original_to = torch.Tensor.to

    def to(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        out = original_to(self, *args, **kwargs)
        target = kwargs.get("device", args[0] if args else None)
        if isinstance(target, (str, torch.device)) and torch.device(target).type == "cpu":
            counter.note(self)  # a device -> host copy
            counter.host(out)
        return out

    monkeypatch.setattr(torch.Tensor, "to", to)
    step = real_train_step

    def counted_step(*args: Any, **kwargs: Any) -> Any:
        counter.in_step.on = True
        try:
            return step(*args, **kwargs)
        finally:
            counter.in_step.on = False
            counter.steps += 1

    monkeypatch.setattr(runner_mod, "train_step", counted_step)
    yield counter


@pytest.mark.timeout(240)
def test_one_host_read_per_optimizer_step_and_two_packets_staged(
    tmp_path: Path, tiny_assets: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real run (in this process, so its tensors can be watched): the pipeline's code reads
    device values exactly once per step (the step's packed reduce; it was 2: the reduce and the
    clip's norm), with grad_accum 2 and the flags, depths and gradient norm in that one read;
    and the drafter never holds more than two staged packets (the current one and the next)."""
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": 6},
        optimizer={**tiny_assets["optimizer"], "grad_accum": 2},
        topology={**tiny_assets["topology"], "hidden_depth": 6},
    )
    alive, most = [0], [0]
    made = stages_mod._with

    def gone() -> None:
        alive[0] -= 1

    def tracked(pkt: Packet, moved: list[torch.Tensor], ready: object) -> Packet:
        out = made(pkt, moved, None)
        alive[0] += 1
        weakref.finalize(out, gone)
        most[0] = max(most[0], alive[0])
        return out

    monkeypatch.setattr(stages_mod, "_with", tracked)
    with counting_syncs(monkeypatch) as counter:
        status = run(RunOptions(cfg, tmp_path / "run"))
    assert status == 0
    assert counter.steps == 6
    sites = counter.pipeline_sites()
    assert list(sites.values()) == [counter.steps], counter.by_site
    assert [s.split(":")[0] for s in sites] == [str(Path(PIPELINE) / "reduce.py")]
    assert 1 <= most[0] <= 2, most[0]


def _packet(seq: int) -> Packet:
    ids = torch.full((1, 3), seq)
    return Packet(ids, torch.ones(1, 3), torch.ones(1, 3), torch.zeros(1, 3, 2), 3)


def test_the_stager_pulls_one_ahead_in_order_and_counts_it_as_waiting() -> None:
    """With 5 packets ready: each get returns the next in order and stages exactly one more,
    so 2 are held at most (the caller drops the previous); depth counts the staged one."""
    buf: ReorderBuffer[Packet] = ReorderBuffer(capacity=8)
    stop = threading.Event()
    for seq in range(5):
        buf.put(seq, _packet(seq), stop)
    feed = Stager(buf, torch.device("cpu"), stop, WaitClock())
    assert feed.depth() == 5
    seq, pkt = feed.get()
    assert seq == 0 and int(pkt.input_ids[0, 0]) == 0
    assert feed.depth() == 4 and buf.depth() == 3  # 1 staged ahead + 3 in the buffer
    got = [seq]
    for _ in range(4):
        del pkt
        seq, pkt = feed.get()
        got.append(seq)
        assert int(pkt.input_ids[0, 0]) == seq
    assert got == [0, 1, 2, 3, 4] and feed.depth() == 0
    stop.set()
    with pytest.raises(Stopped):
        feed.get()


def test_a_packet_waits_where_the_target_made_it(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    """A real target worker (tiny target, the run's plan and store): its packet carries the
    host batch's own tensors (pinned on CUDA) and the features as captured on the target's
    device: nothing is copied towards the drafter before the drafter pulls it."""
    import queue

    from trainer.config import TrainConfig
    from trainer.model.target import TargetModel
    from trainer.pipeline.build import build_parts
    from trainer.pipeline.collate import HostBatch, collate_batch
    from trainer.pipeline.distributed import World
    from trainer.pipeline.faults import FaultPlan
    from trainer.pipeline.stages import Claims, Counter, target_body

    p = build_parts(TrainConfig.from_dict(tiny_assets), World(), tmp_path, FaultPlan())
    bucket = p.plan.batch(0).bucket
    queues: list[queue.Queue[HostBatch]] = [queue.Queue() for _ in range(p.sampler.num_buckets)]
    host = collate_batch(p.store, 0, p.plan.batch(0), False)
    queues[bucket].put(host)
    out: ReorderBuffer[Packet] = ReorderBuffer(capacity=2)
    body = target_body(
        load_target=lambda: TargetModel.load(p.target_dir, p.layer_ids, "cpu", p.target_dtype),
        device="cpu",
        plan=p.plan,
        claims=Claims(0, 1),
        queues=queues,
        out=out,
        stop=threading.Event(),
        clock=WaitClock(),
        done=Counter(),
        faults=FaultPlan(),
    )
    body()
    seq, pkt = out.get(threading.Event())
    assert seq == 0 and pkt.input_ids is host.input_ids and pkt.loss_mask is host.loss_mask
    assert pkt.attention_mask is host.attention_mask and pkt.ready is None
    rows, width = host.input_ids.shape
    assert pkt.hidden.shape == (rows, width, len(p.layer_ids) * p.dcfg.hidden_size)


def test_python_m_trainer_sets_expandable_segments_unless_set(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Before torch can initialise CUDA (even a refused config gets there first); a value the
    operator set is kept."""
    from trainer.__main__ import main

    bad = tmp_path / "bad.toml"
    bad.write_text("[nope]\n")
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    assert main(["--config", str(bad), "--run-dir", str(tmp_path / "r")]) == 2
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:False")
    main(["--config", str(bad), "--run-dir", str(tmp_path / "r")])
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"


TRAINER = str(Path(runner_mod.__file__).parent.parent)

# Ops that read a device tensor's values on the host (a CUDA sync): `.item()`/`int()`/`bool()`
# and what sizes its output by the values (boolean-mask indexing, nonzero, masked_select).
SYNC_OPS = {
    "aten._local_scalar_dense.default",
    "aten.is_nonzero.default",
    "aten.nonzero.default",
    "aten.masked_select.default",
    "aten.equal.default",
    "aten.repeat_interleave.Tensor",
    "aten._unique2.default",
}
MASK_INDEXED = {"aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"}


class DeviceReads(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch's mode is untyped
    """Host reads of "device" values in the drafter's step, by the trainer file:line asking.

    On a CPU run every tensor is a host tensor, so device-ness is tracked: the staged packets'
    tensors (cloned by the test's Stager, so they differ from the host masks they came from)
    and the drafter's parameters are device tensors, and so is every op's output computed from
    one (gradients included); a host copy (`_host_read`) is host memory."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # as the class line
        self.device: dict[int, weakref.ref[torch.Tensor]] = {}
        self.by_site: collections.Counter[str] = collections.Counter()
        self.thread: int | None = None  # the drafter thread, while in its step

    def mark(self, t: torch.Tensor) -> None:
        self.device[id(t)] = weakref.ref(t)

    def on_device(self, t: object) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self.device.get(id(t))
        return ref is not None and ref() is t

    def read(self) -> None:
        frame = sys._getframe(1)
        while frame is not None and not (
            frame.f_code.co_filename.startswith(TRAINER)
            and "site-packages" not in frame.f_code.co_filename
        ):
            frame = frame.f_back  # type: ignore[assignment]  # the loop's end tests it
        where = "?" if frame is None else f"{frame.f_code.co_filename}:{frame.f_lineno}"
        self.by_site[where] += 1

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        flat = [*args, *kwargs.values()]
        flat += [t for a in flat if isinstance(a, (list, tuple)) for t in a]
        from_device = any(self.on_device(a) for a in flat)
        name = str(func)
        if from_device and name in SYNC_OPS:
            self.read()
        elif name in MASK_INDEXED:
            index = args[1] if len(args) > 1 else []
            if any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool and self.on_device(i)
                for i in index
            ):
                self.read()
        out = func(*args, **kwargs)
        if from_device:
            for t in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(t, torch.Tensor):
                    self.mark(t)
        return out


def _host_read(name: str, mode: DeviceReads) -> Callable[..., object]:
    """Tensor.`name` that counts a read of a device tensor in the step's DeviceReads: `.cpu()`,
    `.tolist()`, `.numpy()`, and `.to("cpu")` spelled as the string (a `.to(device)` with a
    torch.device is a move to the compute device, the CPU on this run). The copy is host
    memory from then on (on a CPU run it is the same tensor)."""
    original = getattr(torch.Tensor, name)

    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> object:
        target = kwargs.get("device", args[0] if args else None) if name == "to" else "cpu"
        counted = mode.thread == threading.get_ident() and target == "cpu" and mode.on_device(self)
        out = original(self, *args, **kwargs)
        if counted:
            mode.read()
            if isinstance(out, torch.Tensor):
                mode.device.pop(id(out), None)
        return out

    return read


@pytest.mark.timeout(300)
def test_the_drafter_step_reads_device_values_only_in_its_one_reduce(
    tmp_path: Path, tiny_assets: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The whole drafter step, model code included, with device-ness tracked (DeviceReads;
    the reduce's one read is a `.to("cpu")`, counted by the test above): the anchor draw reads
    the host masks the packet carries (it read the staged masks back: 2 reads per micro-step,
    3 packed), and the objective selects the valid slots by indices known on the host (its
    boolean-mask selections were 5 reads per piece and 1 in backward). grad_accum 2, pieces
    of 64 query rows."""
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": 3},
        optimizer={**tiny_assets["optimizer"], "grad_accum": 2},
        model={**tiny_assets["model"], "max_query_rows": 64},
    )
    made = stages_mod._with
    with counting_syncs(monkeypatch) as counter:
        mode = DeviceReads()

        def staged(pkt: Packet, moved: list[torch.Tensor], ready: object) -> Packet:
            out = made(pkt, [t.clone() for t in moved], None)  # "the drafter's device"
            for t in out.tensors():
                mode.mark(t)
            return out

        counted: Callable[..., Any] = runner_mod.__dict__["train_step"]  # counting_syncs's

        def watched(*args: Any, **kwargs: Any) -> Any:
            for t in [*args[0].drafter.parameters(), *args[0].params]:
                mode.mark(t)
            mode.thread = threading.get_ident()
            try:
                with mode:
                    return counted(*args, **kwargs)
            finally:
                mode.thread = None

        monkeypatch.setattr(stages_mod, "_with", staged)
        monkeypatch.setattr(runner_mod, "train_step", watched)
        for name in ("cpu", "to", "tolist", "numpy"):  # reads that do not dispatch on a CPU run
            monkeypatch.setattr(torch.Tensor, name, _host_read(name, mode))
        status = run(RunOptions(cfg, tmp_path / "run"))
    assert status == 0 and counter.steps == 3
    sites = mode.by_site
    files = {s.rsplit(":", 1)[0].removeprefix(TRAINER + "/") for s in sites}
    # The label check reads only host labels (its CPU branch, here): device labels are checked
    # on the device (tests/kernels/test_label_check_device.py).
    assert files == {"kernels/lm_head_ce.py", "pipeline/reduce.py"}, sites
    reduce_reads = [n for s, n in sites.items() if "pipeline/reduce.py" in s]
    assert reduce_reads == [counter.steps], sites  # the step's one read, seen here too


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@CUDA
def test_cuda_packets_are_staged_on_a_side_stream_and_arrive_whole() -> None:
    """A packet captured on a worker's own stream (an event recorded after it), its masks
    pinned on the host: the stager's copy waits on the event, the compute stream on the copy,
    and the values arrive (onto the same GPU and, with two, from one GPU to the other)."""
    devices = [torch.device("cuda", i) for i in range(min(2, torch.cuda.device_count()))]
    for src, dst in {(devices[0], devices[0]), (devices[-1], devices[0])}:
        stream = stages_mod._stream(src)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(20_000_000)  # type: ignore[no-untyped-call]  # still busy at the copy
            hidden = torch.arange(24, device=src, dtype=torch.float32).view(1, 4, 6)
        ready = stages_mod._event()
        ready.record(stream)
        host = [torch.ones(1, 4, dtype=torch.long).pin_memory() for _ in range(3)]
        buf: ReorderBuffer[Packet] = ReorderBuffer(capacity=2)
        stop = threading.Event()
        buf.put(0, Packet(host[0], host[1], host[2], hidden, 4, ready=ready), stop)
        _, pkt = Stager(buf, dst, stop, WaitClock()).get()
        assert pkt.hidden.device == dst and pkt.input_ids.device == dst
        expected = torch.arange(24, dtype=torch.float32).view(1, 4, 6)
        assert torch.equal(pkt.hidden.cpu(), expected) and int(pkt.loss_mask.sum()) == 4
