"""The sampler's batches as one numbered sequence: micro-batch `seq` -> (epoch, index, Batch).

Every stage addresses work by this global sequence number: prefetch workers walk it, target
workers claim it in order, the drafter consumes it in order through a reorder buffer. The
sequence is a pure function of (data, batching config, seed, rank), which is what makes resume
exact: a checkpoint only needs the next sequence number.
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

import numpy as np

from trainer.sampler import Batch, BatchSampler


@dataclass(frozen=True)
class Position:
    epoch: int
    index: int


class BatchPlan:
    """Thread-safe, cached view of `epochs` (possibly fractional) epochs of a sampler."""

    def __init__(self, sampler: BatchSampler, epochs: float) -> None:
        self.sampler = sampler
        self._lock = threading.Lock()
        self._epochs: dict[int, list[Batch]] = {}
        n_epochs = math.ceil(epochs)
        per_epoch = [sampler.steps_per_epoch(e) for e in range(n_epochs)]
        frac = epochs - math.floor(epochs)
        if frac > 0:
            per_epoch[-1] = max(1, math.floor(per_epoch[-1] * frac))
        self.steps = per_epoch
        self.starts = np.concatenate(([0], np.cumsum(per_epoch))).astype(np.int64)
        self.total = int(self.starts[-1])
        # Real tokens of every rank's batches, cumulative per epoch: ETA counts the whole job.
        self._real_cum: list[np.ndarray] = []
        for e, n in enumerate(per_epoch):
            groups = sampler.global_batches(e)[:n]
            real = np.fromiter((sum(b.real_tokens for b in g) for g in groups), np.int64, n)
            self._real_cum.append(np.concatenate(([0], np.cumsum(real))))
        self.total_real_tokens = int(sum(int(c[-1]) for c in self._real_cum))

    def locate(self, seq: int) -> Position:
        if not 0 <= seq < self.total:
            raise IndexError(f"micro-batch {seq} outside the plan of {self.total}")
        epoch = int(np.searchsorted(self.starts, seq, side="right")) - 1
        return Position(epoch, seq - int(self.starts[epoch]))

    def batch(self, seq: int) -> Batch:
        pos = self.locate(seq)
        with self._lock:
            batches = self._epochs.get(pos.epoch)
            if batches is None:
                batches = self._epochs[pos.epoch] = self.sampler.epoch_batches(pos.epoch)
                for old in [e for e in self._epochs if e < pos.epoch - 1]:
                    del self._epochs[old]  # stages run at most one epoch apart
            return batches[pos.index]

    def seq_of(self, epoch: int, index: int) -> int:
        return int(self.starts[epoch]) + index if epoch < len(self.steps) else self.total

    def real_tokens_before(self, seq: int) -> int:
        """Real tokens (all ranks) in micro-batches [0, seq)."""
        if seq >= self.total:
            return self.total_real_tokens
        pos = self.locate(seq)
        done = sum(int(c[-1]) for c in self._real_cum[: pos.epoch])
        return done + int(self._real_cum[pos.epoch][pos.index])

    def epoch_progress(self, seq: int) -> float:
        """Fractional epochs completed after `seq` micro-batches (the status line's epoch~)."""
        if seq >= self.total:
            pos_epoch = len(self.steps) - 1
            return pos_epoch + 1.0 if self.steps else 0.0
        pos = self.locate(seq)
        full = self.sampler.steps_per_epoch(pos.epoch)
        return pos.epoch + pos.index / full
