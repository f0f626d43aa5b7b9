"""M:N topologies (`topology.targets = "shared"`): target ranks capture for drafter ranks.

torchrun starts N + M processes per node (`distributed.Layout`): the drafter ranks form the
default process group among themselves (data parallel, as in a run without target ranks: the
sampler, the step's reduce, checkpoints and resume see N ranks), each target rank loads the
frozen target on its own device. Drafter d's micro-batch s is captured by target
`layout.source(d, s)`; each target walks its share in the order the drafters consume it
(`layout.served`). Features go point to point on a process group of their own over every
process (gloo on CPU, NCCL on CUDA), so transfers never share a communicator with the
gradient all-reduce. Only the features travel: a drafter collates its batches itself (the plan
is a pure function of the seed and its rank), so shapes are known before anything arrives.

Control goes through torchrun's rendezvous store: drafter 0 publishes where the plan starts
and ends (after resume) and, when training is over, that the targets may go (a gloo wait
cannot be interrupted or time out without closing the connection, so nothing blocks on it for
long). Target ranks ignore SIGINT/SIGTERM: the drafters decide when the run stops. A target
that fails by itself publishes its torchrun rank as the run's first failure
(`checkpoint_sync.publish_failure`), as a drafter does.
"""

from __future__ import annotations

import contextlib
import os
import queue
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import Backend, PrefixStore, Store

from trainer.config import TrainConfig
from trainer.pipeline import assets, checkpoint_sync, distributed
from trainer.pipeline.channels import ReorderBuffer, Stopped, WaitClock, get
from trainer.pipeline.collate import HostBatch, collate_batch
from trainer.pipeline.faults import FaultPlan
from trainer.pipeline.plan import BatchPlan
from trainer.pipeline.stages import Counter, Packet

FEATURES = 0  # the point-to-point tag of a feature tensor
START, RELEASE = "dflash/start", "dflash/release"  # store keys (one launch's store)
TIMEOUT = timedelta(hours=2)  # a send waits this long for a paused drafter (eval, checkpoint)


class Links:
    """This process's end of the features group, and the launch store for control."""

    def __init__(self, process: int, size: int, cuda: bool) -> None:
        self.store: Store = distributed.launch_store()
        self.process = process
        prefix = PrefixStore("dflash/features/", self.store)
        self.group: Backend
        if cuda:
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = TIMEOUT
            self.group = dist.ProcessGroupNCCL(prefix, process, size, opts)
        else:
            self.group = dist.ProcessGroupGloo(prefix, process, size, TIMEOUT)

    def send(self, t: Tensor, dst: int) -> dist.Work:
        work: dist.Work = self.group.send([t], dst, FEATURES)  # type: ignore[attr-defined]  # the backends' send is not in torch's stub
        return work

    def recv(self, t: Tensor, src: int) -> None:
        self.group.recv([t], src, FEATURES).wait()  # type: ignore[attr-defined]  # as send

    def publish(self, key: str, value: str) -> None:
        self.store.set(key, value)

    def wait_for(self, key: str, stop: Callable[[], bool] = lambda: False) -> str | None:
        """The value of `key` once published (polled: never a long blocking wait)."""
        while not self.store.check([key]):
            if stop():
                return None
            time.sleep(0.1)
        return self.store.get(key).decode()


def connect(world: distributed.World) -> Links:
    """A drafter rank's links (every process of the launch builds its own at start-up)."""
    assert world.layout is not None
    cuda = torch.device(world.device).type == "cuda"
    return Links(world.process, world.layout.processes, cuda)


def start_targets(world: distributed.World, links: Links, start: int, end: int) -> None:
    """Drafter 0, after resume: the micro-batches [start, end) every target captures."""
    if world.is_main:
        links.publish(START, f"{start},{end}")


def release_targets(world: distributed.World, links: Links) -> None:
    """Drafter 0, once its training loop is over (every drafter is past its last step, which
    that loop's last reduce or checkpoint joined): the targets may exit."""
    if world.is_main:
        links.publish(RELEASE, "1")


def receiver_body(
    *,
    world: distributed.World,
    links: Links,
    plan: BatchPlan,
    queues: Sequence[queue.Queue[HostBatch]],
    out: ReorderBuffer[Packet],
    start_seq: int,
    end_seq: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device,
    stop: threading.Event,
    clock: WaitClock,
    done: Counter,
) -> Callable[[], None]:
    """A drafter rank's stand-in for target workers: its own host batch (from the prefetch
    queue) and the features its target rank sends for it, in sequence order. It receives a
    packet only when the reorder buffer has room (capacity 1 in M:N), so the drafter's device
    holds the packet in training and at most one more. Its wait clocks are the target stage's
    in the status line: input = waiting for prefetch, output = waiting for the drafter."""
    layout = world.layout
    assert layout is not None

    def body() -> None:
        distributed.bind_thread(device)
        for seq in range(start_seq, end_seq):
            host = get(queues[plan.batch(seq).bucket], stop, clock)
            assert host.seq == seq, (host.seq, seq)  # one receiver: the queue is in order
            out.wait_room(seq, stop, clock)
            rows, length = host.input_ids.shape
            hidden = torch.empty(rows, length, width, dtype=dtype, device=device)
            src = layout.target_process(layout.source(world.rank, seq))
            try:
                links.recv(hidden, src)
            except RuntimeError:
                # The targets exit once drafter 0 is done: a receive posted for a batch past
                # this rank's last step fails then, as it should; anything else is a failure.
                if stop.wait(60.0):
                    raise Stopped from None
                raise
            done.add()
            packet = Packet(
                host.input_ids,
                host.loss_mask,
                host.attention_mask,
                hidden,
                host.real_tokens,
                host.position_ids,
            )
            out.put(seq, packet, stop, clock)

    return body


def serve(cfg: TrainConfig, rank: distributed.TargetRank) -> int:
    """A target rank's whole life: wait for the plan's range, capture and send every batch
    it serves, in order, at most `topology.hidden_depth` sends in flight; exit 0 at the end
    of the plan or when drafter 0 releases the targets."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)  # the drafters decide when the run stops
    device = torch.device(rank.device)
    links = Links(rank.process, rank.layout.processes, device.type == "cuda")
    value = links.wait_for(START)
    assert value is not None
    start, end = (int(x) for x in value.split(","))
    served = threading.Event()

    def watch() -> None:  # exit as soon as drafter 0 is done, even mid-send
        if links.wait_for(RELEASE, stop=served.is_set) is not None:
            os._exit(0)  # nothing to save here; a send in flight may never complete

    # not a daemon: one blocked in the store when the interpreter exits aborts the process
    watcher = threading.Thread(target=watch, name="release")
    watcher.start()
    try:
        _capture_all(cfg, rank, links, start, end)
    except Exception as exc:
        if not checkpoint_sync.peer_failure(exc):  # the drafters' failed_rank names this one
            checkpoint_sync.publish_failure(rank.process)
        raise
    finally:
        served.set()
        watcher.join()
    return 0


def _capture_all(
    cfg: TrainConfig, rank: distributed.TargetRank, links: Links, start: int, end: int
) -> None:
    from trainer.model.target import TargetModel
    from trainer.pipeline.build import plans_for, target_dtype
    from trainer.pipeline.evals import quiet_hf
    from trainer.pipeline.stages import capture_batch

    device = torch.device(rank.device)
    store, plans = plans_for(cfg, rank.layout.drafters)
    quiet_hf()
    tdir = assets.ensure_target(cfg)
    hf = assets.target_hf_config(tdir)
    dtype = target_dtype(cfg, torch.device(cfg.topology.drafter_devices[0]))
    target = TargetModel.load(tdir, assets.layer_ids_for(cfg, hf), device, dtype)
    faults = FaultPlan()
    pin = device.type == "cuda"
    stream = torch.cuda.Stream(device) if pin else None  # type: ignore[no-untyped-call]  # torch leaves it unannotated
    in_flight: deque[tuple[dist.Work, Tensor]] = deque()
    for d, seq in rank.layout.served(rank.index, start, end):
        host = collate_batch(store, seq, plans[d].batch(seq), pin)
        faults.tick("target")
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            hidden = capture_batch(target, host, device, cfg.model.loss.distills)
            if len(in_flight) >= cfg.topology.hidden_depth:
                _sent(in_flight.popleft()[0], pin)
            in_flight.append((links.send(hidden, rank.layout.drafter_process(d)), hidden))
    while in_flight:
        _sent(in_flight.popleft()[0], pin)


def _sent(work: dist.Work, cuda: bool) -> None:
    """Wait for a send: gloo's wait blocks this thread; NCCL's only orders the stream, so the
    host polls the send's completion too (else captures would run ahead of the sends and
    memory would grow past `hidden_depth` packets)."""
    work.wait()
    while cuda and not work.is_completed():
        time.sleep(0.001)
