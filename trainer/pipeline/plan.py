"""The sampler's batches as one numbered sequence: micro-batch `seq` -> (epoch, index, Batch).

Every stage addresses work by this global sequence number: prefetch workers walk it, target
workers claim it in order, the drafter consumes it in order through a reorder buffer. The
sequence is a pure function of (data, batching config, seed, rank), which is what makes resume
exact: the sequence number is the run's one resume position. A checkpoint records it as the
(epoch, index) it falls on plus the sampler's fingerprint (`state_dict`), and `load_state_dict`
turns that back into the sequence number, refusing state from other data or settings.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from trainer.sampler import Batch, BatchSampler, SamplerError
from trainer.sampler_state import STATE_VERSION


@dataclass(frozen=True)
class Position:
    epoch: int
    index: int


class BatchPlan:
    """Thread-safe view of `epochs` (possibly fractional) epochs of a sampler; it keeps this
    rank's batches of the (at most two) epochs the stages are in."""

    def __init__(self, sampler: BatchSampler, epochs: float) -> None:
        self.sampler = sampler
        self._lock = threading.Lock()
        self._epochs: dict[int, list[Batch]] = {}
        n_epochs = math.ceil(epochs)
        self._real_cum: list[np.ndarray] = []
        self.full_steps: list[int] = []  # steps of each whole epoch (the epoch~ denominator)
        per_epoch: list[int] = []
        for e in range(n_epochs):
            groups = sampler.global_batches(e)
            self.full_steps.append(len(groups))
            per_epoch.append(len(groups))
            if e == n_epochs - 1 and epochs - math.floor(epochs) > 0:
                per_epoch[-1] = max(1, math.floor(len(groups) * (epochs - math.floor(epochs))))
            n = per_epoch[-1]
            # Real tokens of every rank's batches, cumulative per epoch: ETA counts the whole job.
            real = np.fromiter((sum(b.real_tokens for b in g) for g in groups[:n]), np.int64, n)
            self._real_cum.append(np.concatenate(([0], np.cumsum(real))))
            if e < 2:  # the first epochs the stages read: computed once
                self._epochs[e] = [g[sampler.rank] for g in groups]
        self.steps = per_epoch
        self.starts = np.concatenate(([0], np.cumsum(per_epoch))).astype(np.int64)
        self.total = int(self.starts[-1])
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
        return pos.epoch + pos.index / self.full_steps[pos.epoch]

    # ----- the resume position -------------------------------------------------------------
    def state_dict(self, seq: int) -> dict[str, object]:
        """The checkpoint's `sampler` entry for resuming at micro-batch `seq` (JSON-safe): the
        (epoch, index) it falls on, and the fingerprint of what it is valid for."""
        # The plan's end is the last epoch's end (not the next epoch's start): a run extended
        # from a fractional epoch count continues inside that epoch.
        last = len(self.steps) - 1
        pos = self.locate(seq) if seq < self.total else Position(last, self.steps[last])
        return {
            "version": STATE_VERSION,
            "epoch": pos.epoch,
            "position": pos.index,
            "fingerprint": self.sampler.fingerprint(),
            "config": dict(self.sampler.fingerprint_config),
        }

    def load_state_dict(self, state: Mapping[str, object]) -> int:
        """The micro-batch sequence number `state` resumes at; SamplerError when it comes from
        other data or settings, or lies outside its epoch."""
        self.sampler.check_state(state)
        epoch, index = state.get("epoch"), state.get("position")
        if not isinstance(epoch, int) or not isinstance(index, int):
            raise SamplerError(f"sampler state position ({epoch!r}, {index!r}) is not two integers")
        if epoch < len(self.full_steps):
            full = self.full_steps[epoch]
        else:  # past this plan's epochs (fewer epochs now): the plan is done
            full = self.sampler.steps_per_epoch(epoch) if epoch >= 0 else -1
        if epoch < 0 or not 0 <= index <= full:
            raise SamplerError(f"sampler state position ({epoch}, {index}) is out of range")
        return min(self.seq_of(epoch, index), self.total)
