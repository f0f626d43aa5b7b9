"""The main thread's watch over a running pipeline: the stages' wait clocks and rate windows,
and a status line every `status.interval_s` (so a starving stage shows in the line itself)."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from trainer.pipeline.build import Parts
from trainer.pipeline.channels import ReorderBuffer, WaitClock
from trainer.pipeline.collate import HostBatch
from trainer.pipeline.signals import StopSignals
from trainer.pipeline.stages import Counter, Packet, Stager
from trainer.pipeline.status import (
    Board,
    RateWindow,
    Reporter,
    RunRecord,
    status_line,
    wait_percent,
)
from trainer.pipeline.track import TrackerSink


@dataclass(frozen=True)
class Queues:
    """The channels between the stages (their depths are in the status line)."""

    pre: list[queue.Queue[HostBatch]]  # prefetch -> target, one per bucket
    hs: ReorderBuffer[Packet]  # target -> drafter, in sequence order
    feed: Stager  # the drafter's end of `hs` (with the packet staged ahead on its device)


class Monitor:
    """Owns the wait clocks the stages tick, the rate windows, and the status line."""

    def __init__(
        self,
        p: Parts,
        board: Board,
        reporter: Reporter,
        tracker: TrackerSink,
        last_tau: Callable[[], float | None],
        t0: float,
    ) -> None:
        self.p, self.board, self.reporter, self.tracker = p, board, reporter, tracker
        self.last_tau, self.t0 = last_tau, t0
        self.pre_clocks = [WaitClock() for _ in range(p.sampler.num_buckets)]
        # one per target worker; M:N: the rank's receiver, which stands in for them
        self.tgt_clocks = [WaitClock() for _ in range(max(1, len(p.target_devices)))]
        self.dft_clock = WaitClock()
        self.tgt_done = Counter()  # micro-batches the targets captured
        window = p.cfg.status.rate_window_s
        self.windows = {k: RateWindow(window) for k in ("tgt", "dft", "tok")}
        self._since: dict[tuple[int, str], float] = {}
        self._watched = (
            (self.pre_clocks, "output_s", "w_pre_out"),
            (self.tgt_clocks, "input_s", "w_tgt_in"),
            (self.tgt_clocks, "output_s", "w_tgt_out"),
            ([self.dft_clock], "input_s", "w_dft_in"),
        )

    def waits(self, dt: float) -> dict[str, float]:
        """Percent of the last `dt` seconds each stage spent blocked."""
        return {key: wait_percent(c, attr, self._since, dt) for c, attr, key in self._watched}

    def loop(
        self,
        queues: Queues,
        drafter: threading.Thread,
        stop: threading.Event,
        signals: StopSignals,
        record: RunRecord,
        end_micro: int,
    ) -> None:
        """Until the drafter ends or the pipeline stops: a status line every interval."""
        interval = self.p.cfg.status.interval_s
        last_t = next_t = time.monotonic()
        first = True
        while drafter.is_alive() and not stop.is_set():
            if signals.requested.is_set():
                signals.announce()
            now = time.monotonic()
            if now < next_t:
                drafter.join(min(0.1, next_t - now))
                continue
            self.p.faults.tick("monitor")
            if first:
                self.waits(1.0)  # baseline the clocks
            self.emit(queues, end_micro, now, None if first else self.waits(now - last_t))
            if not first:  # a corrupted run-state heals within a line
                record.heal()
            first, last_t = False, now
            next_t += interval
            if next_t < now:
                next_t = now + interval

    def emit(
        self, queues: Queues, end_micro: int, now: float, waits: dict[str, float] | None
    ) -> None:
        """One status line (stdout, status.log, trackers)."""
        b, plan, world = self.board, self.p.plan, self.p.world
        tgt = self.windows["tgt"].add(now, self.tgt_done.value)
        dft = self.windows["dft"].add(now, b.micro)
        tok = self.windows["tok"].add(now, b.real_tokens if b.real_tokens else 0)
        ktok = tok / 1000 if tok is not None else None
        remaining = plan.real_tokens_before(end_micro) - plan.real_tokens_before(b.micro)
        eta = remaining / tok if tok and tok > 0 else None
        # One rank sees its own buffer live; the others' depths come with each step's reduce.
        q_hs = [queues.feed.depth()] if world.size == 1 or not b.q_hs else b.q_hs
        nb = self.p.sampler.num_buckets  # loss_b only when batches come from several buckets
        line = status_line(
            elapsed_s=now - self.t0,
            board=b,
            metrics=b.take_metrics(),
            noise=self.p.cfg.model.noise,
            tgt_bps=tgt,
            dft_bps=dft,
            ktok_s=ktok,
            q_pre=[q.qsize() for q in queues.pre],
            q_hs=q_hs,
            epoch=plan.epoch_progress(b.micro),
            eta_s=eta,
            waits=waits,
            tau=self.last_tau(),
            bucket_losses=b.take_bucket_losses(nb) if nb > 1 else None,
            loss_type=self.p.cfg.model.loss.label(),
        )
        self.reporter.line(line)
        self.tracker.track(line)
