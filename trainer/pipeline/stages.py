"""Pipeline stage threads: prefetch workers (store -> padded tensors, one queue per bucket) and
target workers (frozen target on its device -> hidden-state packets for the drafter).

Each stage body is a plain function run by `Supervisor.spawn`; it returns normally at the end of
the plan, returns on `Stopped` when another stage failed or a stop was requested, and any other
exception stops the whole pipeline with the stage's name and traceback.
"""

from __future__ import annotations

import queue
import threading
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from trainer.data.store import TokenStore
from trainer.model.target import TargetModel
from trainer.pipeline.channels import ReorderBuffer, Stopped, WaitClock, get, put
from trainer.pipeline.collate import HostBatch, collate_batch
from trainer.pipeline.faults import FaultPlan
from trainer.pipeline.plan import BatchPlan


@dataclass
class Packet:
    """A micro-batch with its captured target features, on the drafter's device."""

    input_ids: Tensor
    loss_mask: Tensor
    attention_mask: Tensor
    hidden: Tensor  # [B, L, F*H]
    real_tokens: int
    position_ids: Tensor | None = None  # [B, L] document-relative (packed rows); None: 0..L-1


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
) -> Callable[[], None]:
    """A prefetch worker that owns `buckets` and fills their queues in sequence order."""
    mine = set(buckets)

    def body() -> None:
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


def target_body(
    *,
    load_target: Callable[[], TargetModel],
    plan: BatchPlan,
    claims: Claims,
    queues: Sequence[queue.Queue[HostBatch]],
    out: ReorderBuffer[Packet],
    drafter_device: torch.device,
    stop: threading.Event,
    clock: WaitClock,
    done: Counter,
    faults: FaultPlan,
) -> Callable[[], None]:
    """A target worker: claim the next sequence number, take its bucket's next batch, capture."""

    def body() -> None:
        target = load_target()
        device = target.device
        while (seq := claims.claim()) is not None:
            bucket = plan.batch(seq).bucket
            host = get(queues[bucket], stop, clock)  # FIFO per bucket: this is seq or a peer's
            faults.tick("target")
            ids = host.input_ids.to(device, non_blocking=True)
            attn = host.attention_mask.to(device, non_blocking=True)
            pos = host.position_ids
            pos = None if pos is None else pos.to(device, non_blocking=True)
            hidden = target.capture(ids, attn, position_ids=pos)
            packet = Packet(
                input_ids=ids.to(drafter_device, non_blocking=True),
                loss_mask=host.loss_mask.to(drafter_device, non_blocking=True),
                attention_mask=attn.to(drafter_device, non_blocking=True),
                hidden=hidden.to(drafter_device, non_blocking=True),
                real_tokens=host.real_tokens,
                position_ids=None if pos is None else pos.to(drafter_device, non_blocking=True),
            )
            if device.type == "cuda":
                torch.cuda.current_stream(device).synchronize()  # copies done before handoff
            done.add()
            out.put(host.seq, packet, stop, clock)

    return body
