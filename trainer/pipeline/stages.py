"""Pipeline stage threads: prefetch workers (store -> padded tensors, one queue per bucket) and
target workers (frozen target on its device -> hidden-state packets for the drafter), and the
drafter's `Stager`, which moves packets onto the drafter's device one ahead of use.

On CUDA: a target worker captures on its own stream and records an event; its packet keeps the
features on the target GPU (the host tensors pinned) while it waits in the reorder buffer, so
the reorder buffer's depth costs target memory, not drafter memory. The drafter pulls packet
n+1 onto its GPU on a side stream (waiting on the capture's event, reading the source on a
stream of the source device, `record_stream` on both sides) while it trains on packet n: the
drafter GPU holds at most two packets, and no copy queues behind either side's compute.

Each stage body is a plain function run by `Supervisor.spawn`; it returns normally at the end of
the plan, returns on `Stopped` when another stage failed or a stop was requested, and any other
exception stops the whole pipeline with the stage's name and traceback.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.data.store import TokenStore
from trainer.model.target import TargetModel
from trainer.pipeline import distributed
from trainer.pipeline.channels import ReorderBuffer, Stopped, WaitClock, get, put
from trainer.pipeline.collate import HostBatch, collate_batch
from trainer.pipeline.faults import FaultPlan
from trainer.pipeline.plan import BatchPlan


@dataclass
class Packet:
    """A micro-batch with its captured target features. From a target worker: the features on
    the target's device, the rest on the host (pinned on CUDA); from `Stager.get`: all on the
    drafter's device."""

    input_ids: Tensor
    loss_mask: Tensor
    attention_mask: Tensor
    hidden: Tensor  # [B, L, F*H]
    real_tokens: int
    position_ids: Tensor | None = None  # [B, L] document-relative (packed rows); None: 0..L-1
    ready: torch.cuda.Event | None = None  # CUDA: recorded once the tensors are written
    # From `Stager.get`: the host tensors the masks were copied from (None: the packet's own
    # masks are those). The anchor draw reads them, so it never waits on the drafter's device.
    host: HostMasks | None = None

    def tensors(self) -> list[Tensor]:
        t = [self.input_ids, self.loss_mask, self.attention_mask, self.hidden]
        return t if self.position_ids is None else [*t, self.position_ids]

    def host_masks(self) -> HostMasks:
        """The masks on the host: the staged copies' sources, else the packet's own."""
        if self.host is not None:
            return self.host
        return HostMasks(self.loss_mask, self.attention_mask, self.position_ids)


@dataclass(frozen=True)
class HostMasks:
    """A packet's loss mask, attention mask and position ids as the prefetcher made them (host
    memory, pinned on CUDA): what the anchor draw reads (`masks.sample_anchors`)."""

    loss_mask: Tensor
    attention_mask: Tensor
    position_ids: Tensor | None


class Supervisor:
    """Owns the shared stop event and the first failure; every stage thread runs under it."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.failure: tuple[str, BaseException, str] | None = None
        self.threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def fail(self, stage: str, exc: BaseException) -> None:
        with self._lock:
            if self.failure is None:
                self.failure = (stage, exc, traceback.format_exc())
        self.stop.set()

    def spawn(self, stage: str, body: Callable[[], None]) -> threading.Thread:
        def run() -> None:
            try:
                body()
            except Stopped:
                pass
            except BaseException as exc:
                self.fail(stage, exc)

        thread = threading.Thread(target=run, name=stage, daemon=True)
        self.threads.append(thread)
        thread.start()
        return thread

    def join(self, timeout: float) -> list[str]:
        """Join all threads; returns the names of those still alive after `timeout`."""
        for t in self.threads:
            t.join(timeout)
        return [t.name for t in self.threads if t.is_alive()]


def prefetch_body(
    *,
    plan: BatchPlan,
    store: TokenStore,
    buckets: Sequence[int],
    queues: Sequence[queue.Queue[HostBatch]],
    start_seq: int,
    end_seq: int,
    stop: threading.Event,
    clock: WaitClock,
    faults: FaultPlan,
    pin: bool,
    device: torch.device | str = "cpu",
) -> Callable[[], None]:
    """A prefetch worker that owns `buckets` and fills their queues in sequence order.
    `device`: the rank's GPU, bound before pinning (else pinning makes a context on cuda:0)."""
    mine = set(buckets)

    def body() -> None:
        if pin:
            distributed.bind_thread(device)
        for seq in range(start_seq, end_seq):
            batch = plan.batch(seq)
            if batch.bucket not in mine:
                continue
            faults.tick("prefetch")
            put(queues[batch.bucket], collate_batch(store, seq, batch, pin), stop, clock)

    return body


class Claims:
    """Hands out sequence numbers in order to target workers (the order batches are consumed)."""

    def __init__(self, start: int, end: int) -> None:
        self._next, self._end = start, end
        self._lock = threading.Lock()

    def claim(self) -> int | None:
        with self._lock:
            if self._next >= self._end:
                return None
            seq, self._next = self._next, self._next + 1
            return seq


class Counter:
    """A monotone event counter shared by the workers of one stage (for the b/s rates)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def add(self, n: int = 1) -> None:
        with self._lock:
            self.value += n


def capture_batch(
    target: TargetModel, host: HostBatch, device: torch.device, final: bool = False
) -> Tensor:
    """`host`'s hidden features from `target`: its ids, attention mask and position ids copied
    to `device` without blocking (on CUDA the caller's current stream orders them), captured.
    `final` (logit distillation): the target's last hidden state rides as one more feature
    (`TargetModel.capture`); the drafter step splits it off (`step.split_teacher`)."""
    ids = host.input_ids.to(device, non_blocking=True)
    attn = host.attention_mask.to(device, non_blocking=True)
    pos = host.position_ids
    pos = None if pos is None else pos.to(device, non_blocking=True)
    return target.capture(ids, attn, position_ids=pos, final=final)


def target_body(
    *,
    load_target: Callable[[], TargetModel],
    device: str,
    plan: BatchPlan,
    claims: Claims,
    queues: Sequence[queue.Queue[HostBatch]],
    out: ReorderBuffer[Packet],
    stop: threading.Event,
    clock: WaitClock,
    done: Counter,
    faults: FaultPlan,
    final: bool = False,
) -> Callable[[], None]:
    """A target worker: claim the next sequence number, take its bucket's next batch, capture
    (`final`: with the last hidden state, `capture_batch`).

    The packet's features stay on the target's device (on CUDA: captured on this worker's
    own stream, with an event the drafter's copy waits on; no host sync here)."""

    def body() -> None:
        distributed.bind_thread(device)
        target = load_target()
        dev = target.device
        stream = _stream(dev) if dev.type == "cuda" else None
        while (seq := claims.claim()) is not None:
            bucket = plan.batch(seq).bucket
            host = get(queues[bucket], stop, clock)  # FIFO per bucket: this is seq or a peer's
            faults.tick("target")
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                hidden = capture_batch(target, host, dev, final)
            ready = None
            if stream is not None:
                ready = _event()
                ready.record(stream)
            packet = Packet(
                input_ids=host.input_ids,
                loss_mask=host.loss_mask,
                attention_mask=host.attention_mask,
                hidden=hidden,
                real_tokens=host.real_tokens,
                position_ids=host.position_ids,
                ready=ready,
            )
            done.add()
            out.put(host.seq, packet, stop, clock)

    return body


class Stager:
    """The drafter's end of the reorder buffer: packets on the drafter's device, in order.

    `get` returns packet n (staged by the previous call when it was ready then, else fetched
    now) and starts staging n+1 if it is ready: the copy overlaps the training on n. The caller
    drops packet n-1 before asking for n, so at most two packets are on the drafter's device.
    Off CUDA a packet is moved with a plain `.to` (a no-op when everything is on the CPU)."""

    def __init__(
        self,
        buffer: ReorderBuffer[Packet],
        device: torch.device,
        stop: threading.Event,
        clock: WaitClock,
        *,
        ahead: bool = True,
    ) -> None:
        self.buffer, self.device, self.stop, self.clock = buffer, device, stop, clock
        self.ahead = ahead  # False: packets arrive on the device already (M:N)
        self._staged: tuple[int, Packet] | None = None
        self._copy: torch.cuda.Stream | None = None
        self._pull: dict[torch.device, torch.cuda.Stream] = {}  # per source GPU

    def get(self) -> tuple[int, Packet]:
        staged, self._staged = self._staged, None
        if staged is None:
            staged = self._stage(*self.buffer.get(self.stop, self.clock))
        nxt = self.buffer.poll() if self.ahead else None
        if nxt is not None:
            self._staged = self._stage(*nxt)
        seq, pkt = staged
        if pkt.ready is not None:  # CUDA: the compute stream waits for the copy
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(pkt.ready)
            for t in pkt.tensors():
                t.record_stream(compute)  # made on another stream, freed after its last use here
        return seq, pkt

    def depth(self) -> int:
        """Packets waiting for the drafter: in the buffer, and the one staged ahead."""
        return self.buffer.depth() + (self._staged is not None)

    def _stage(self, seq: int, pkt: Packet) -> tuple[int, Packet]:
        if self.device.type != "cuda":
            if pkt.ready is not None:
                pkt.ready.synchronize()  # captured on a CUDA target for a CPU drafter
            moved = [t if t.device == self.device else t.to(self.device) for t in pkt.tensors()]
            return seq, _with(pkt, moved, None)
        if self._copy is None:
            self._copy = _stream(self.device)
        copy = self._copy
        with torch.cuda.stream(copy):
            if pkt.ready is not None:
                copy.wait_event(pkt.ready)
            moved = [self._move(t, pkt.ready) for t in pkt.tensors()]
            ready = _event()
            ready.record(copy)
        return seq, _with(pkt, moved, ready)

    def _move(self, t: Tensor, ready: torch.cuda.Event | None) -> Tensor:
        """`t` onto the drafter's device, queued on the copy stream (the current one)."""
        src = t.device
        if src == self.device:
            return t
        if src.type != "cuda":  # host: pinned by the prefetcher, so this does not block
            return t.to(self.device, non_blocking=True)
        # GPU to GPU: torch copies on the source device's current stream, so read on a pull
        # stream of our own there (the target's stream has its next capture queued).
        pull = self._pull.get(src)
        if pull is None:
            pull = self._pull[src] = _stream(src)
        if ready is not None:
            pull.wait_event(ready)
        with torch.cuda.stream(pull):
            out = t.to(self.device, non_blocking=True)
        t.record_stream(pull)  # the target's memory is not reused before the copy has read it
        return out


def _stream(device: torch.device) -> torch.cuda.Stream:
    return torch.cuda.Stream(device)  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def _event() -> torch.cuda.Event:
    return torch.cuda.Event()  # type: ignore[no-untyped-call]  # torch leaves it unannotated


def _with(pkt: Packet, moved: list[Tensor], ready: torch.cuda.Event | None) -> Packet:
    """`pkt` with its tensors `moved`; its host masks travel along (the anchor draw's)."""
    ids, loss, attn, hidden, *pos = moved
    host = pkt.host
    masks = [
        pkt.loss_mask,
        pkt.attention_mask,
        *([] if pkt.position_ids is None else [pkt.position_ids]),
    ]
    if host is None and all(t.device.type == "cpu" for t in masks):
        host = HostMasks(pkt.loss_mask, pkt.attention_mask, pkt.position_ids)
    return Packet(ids, loss, attn, hidden, pkt.real_tokens, pos[0] if pos else None, ready, host)
