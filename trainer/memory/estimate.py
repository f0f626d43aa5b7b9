"""Will the run fit? Per device: fixed costs plus the peak of the worst batch; the largest budget.

A drafter device holds the fixed state (`costs.drafter_fixed`), two feature packets (the one in
use and the one the drafter's Stager pulls ahead: `pipeline.stages.Stager`; in an M:N run the
one received ahead) and the worst micro-step's activations (`costs.activation_peak`) over every
batch shape the sampler produces, split by `model.max_query_rows` exactly as the trainer splits
it. A target device holds the target's weights, one layer's capture working set and the
features of the batch it captures at the largest padded batch, and the features of the packets
waiting for the drafter there: up to `topology.hidden_depth` (the q_hs buffer's capacity, whose
packets keep their features on the target that made them, and claims are dynamic, so one target
may hold most of them; in an M:N run a target rank's sends in flight). `reserve` is what CUDA
itself takes (context, cuBLAS workspace, allocator slack): a guess, not measured here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from trainer.config import TrainConfig
from trainer.memory.batches import BatchShape, Shapes, ShapeTable, piece_table, pieces
from trainer.memory.costs import (
    Backend,
    Ints,
    Piece,
    activation_peak,
    activation_peaks,
    drafter_fixed,
    target_peak,
)
from trainer.memory.shapes import DrafterShape, TargetShape

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
UNPACKED_SLOT_BYTES = 4 * 8  # ids, loss and attention masks, gather index: int64 each


@dataclass(frozen=True)
class Precision:
    compute: int  # bytes of the drafter's compute dtype (bf16 autocast on CUDA)
    features: int  # bytes of the target dtype (captured features, borrowed head)
    backend: Backend


def precision_for(cfg: TrainConfig) -> Precision:
    """What the trainer picks: bf16 autocast and flex on CUDA; fp32 and SDPA on CPU."""
    cuda = any(d.startswith("cuda") for d in cfg.topology.drafter_devices)
    name = cfg.topology.target_dtype
    feat = DTYPE_BYTES[name] if name != "auto" else (2 if cuda else 4)
    return Precision(2 if cuda else 4, feat, "flex" if cuda else "sdpa")


@dataclass
class DrafterPlan:
    """The drafter side's numbers at one `max_query_rows`."""

    max_query_rows: int | None
    peak: int
    worst: BatchShape
    worst_piece: Piece
    activations: int
    packet: int


@dataclass
class Estimator:
    cfg: TrainConfig
    target: TargetShape
    drafter: DrafterShape
    shapes: Shapes
    precision: Precision
    _act: dict[Piece, int] = field(default_factory=dict)
    _fixed: dict[str, int] | None = None

    @property
    def _captured(self) -> int:
        """Hidden-size-wide features per token a packet carries: the captured layers, and the
        target's last hidden state when the run distills (`[model.loss] kd_weight`)."""
        return self.drafter.features + int(self.cfg.model.loss.distills)

    @property
    def _packet_token_bytes(self) -> int:
        """Features [R, S, F*H] in the target dtype (one more H with distillation), plus ids,
        attention and loss masks (and packed rows' position ids), per packet token."""
        feat = self._captured * self.drafter.hidden * self.precision.features
        per_token = 4 if self.shapes.row_length is not None else 3
        return feat + per_token * 8

    def packet_bytes(self, shape: BatchShape) -> int:
        return shape.packet_tokens * self._packet_token_bytes

    def unpacked_bytes(self, shape: BatchShape) -> int:
        """The step's one-document-per-row layout of a packed packet (ids, two masks and the
        gather index, `UNPACKED_SLOT_BYTES` a slot; the features stay packed); 0 when it keeps
        the packet's rows."""
        return 0 if shape.packet is None else shape.rows * shape.seq * UNPACKED_SLOT_BYTES

    def _activation(self, piece: Piece) -> int:
        got = self._act.get(piece)
        if got is None:
            p = self.precision
            got = activation_peak(
                self.drafter, piece, c=p.compute, feature_bytes=p.features, backend=p.backend
            )
            self._act[piece] = got
        return got

    def fixed(self) -> dict[str, int]:
        if self._fixed is None:
            self._fixed = self._fixed_items()
        return dict(self._fixed)

    def _fixed_items(self) -> dict[str, int]:
        fx = drafter_fixed(
            self.drafter,
            self.target,
            target_bytes=self.precision.features,
            c=self.precision.compute,
        )
        worst_packet = int(self._table.packet_tokens.max()) * self._packet_token_bytes
        staged = 1  # pulled ahead by the Stager; the one in use is the plan's `packet`
        return {
            "master_weights_fp32": fx.master,
            "grads_fp32": fx.grads,
            "adamw_moments_fp32": fx.adam,
            "autocast_weight_cache": fx.autocast_cache,
            "borrowed_embedding_lm_head": fx.borrowed,
            "staged_packets": staged * worst_packet,
        }

    @cached_property
    def _table(self) -> ShapeTable:
        return ShapeTable.of(self.shapes.batches)

    @cached_property
    def _extra(self) -> Ints:
        """Per shape, the bytes besides its activations: the packet, the noise's copy of the
        features, the unpacked layout (`packet_bytes`, `unpacked_bytes`, as arrays)."""
        t = self._table
        packet = t.packet_tokens * self._packet_token_bytes
        noise = packet if self.cfg.model.noise > 0 else 0
        unpacked = np.where(t.packed_tokens > 0, t.rows * t.seq * UNPACKED_SLOT_BYTES, 0)
        extra: Ints = packet + noise + unpacked
        return extra

    def plan(self, max_query_rows: int | None) -> DrafterPlan:
        """The worst batch shape at `max_query_rows`: every shape's pieces priced at once
        (`piece_table`, `activation_peaks`); the first shape (in `Shapes.batches` order) with
        the largest peak, and its first worst piece (in `pieces` order)."""
        t, p = self._table, self.precision
        pt = piece_table(t, self.drafter.block, max_query_rows)
        act = activation_peaks(
            self.drafter,
            pt.rows,
            t.seq[pt.shape],
            pt.width,
            t.packed_tokens[pt.shape],
            c=p.compute,
            feature_bytes=p.features,
            backend=p.backend,
        )
        worst = np.zeros(len(t), dtype=np.int64)
        np.maximum.at(worst, pt.shape, act)
        i = int(np.argmax(worst + self._extra))  # the first of the largest
        shape = self.shapes.batches[i]
        act_i, piece = max(
            (
                (self._activation(q), q)
                for q in pieces(shape, self.drafter.block, max_query_rows, widest_run=True)
            ),
            key=lambda pair: pair[0],
        )
        return DrafterPlan(
            max_query_rows,
            act_i + int(self._extra[i]),
            shape,
            piece,
            act_i,
            self.packet_bytes(shape),
        )

    def drafter_peak(self, max_query_rows: int | None) -> tuple[int, DrafterPlan]:
        plan = self.plan(max_query_rows)
        return sum(self.fixed().values()) + plan.peak, plan

    def largest_budget(self, available: int) -> int | None:
        """Largest max_query_rows (a multiple of the block) whose drafter peak fits, or None."""
        block = self.drafter.block
        top = int((self._table.rows * self._table.width).max())  # widest query rows / block
        fixed = sum(self.fixed().values())
        if fixed + self.plan(block).peak > available:
            return None
        lo, hi = 1, max(top, 1)  # lo fits; find the largest k with k * block fitting
        if fixed + self.plan(hi * block).peak <= available:
            return hi * block
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if fixed + self.plan(mid * block).peak <= available:
                lo = mid
            else:
                hi = mid
        return lo * block

    def per_query_row(self) -> int:
        """Bytes one query row keeps for backward, all layers + final norm + CE input."""
        from trainer.memory.costs import per_query_row_layer, per_query_row_shared

        d, p = self.drafter, self.precision
        return d.layers * per_query_row_layer(d, p.compute, p.backend) + per_query_row_shared(
            d, p.compute
        )

    def target_device(self) -> dict[str, int]:
        """A target device's items: `costs.target_peak` and the packets waiting there."""
        tokens = int(self._table.packet_tokens.max())
        items = target_peak(
            self.target, tokens, self._captured, dtype_bytes=self.precision.features
        )
        items["waiting_packets"] = self.cfg.topology.hidden_depth * items["captured_features"]
        return items


def report(est: Estimator, device_memory: int, reserve: int) -> dict[str, Any]:
    """The JSON the CLI prints (and `dflashctl deploy`'s preflight is to read)."""
    cfg = est.cfg
    available = device_memory - reserve
    configured = cfg.model.max_query_rows
    fixed = est.fixed()
    fixed_total = sum(fixed.values())
    peak, plan = est.drafter_peak(configured)
    unbounded_peak, unbounded = est.drafter_peak(None)
    largest = est.largest_budget(available)
    tgt = est.target_device()
    tgt_peak = sum(tgt.values())
    block = est.drafter.block

    def plan_json(p: DrafterPlan, total: int) -> dict[str, Any]:
        return {
            "max_query_rows": p.max_query_rows,
            "peak": total,
            "fits": total <= available,
            "activations": p.activations,
            "packet_in_use": p.packet,
            "worst_batch": {
                "rows": p.worst.rows,
                "seq": p.worst.seq,
                "anchors_per_row_max": p.worst.width,
                "query_rows": p.worst.query_rows(block),
            },
            "worst_piece": {
                "rows": p.worst_piece.rows,
                "seq": p.worst_piece.seq,
                "anchors": p.worst_piece.width,
                "query_rows": p.worst_piece.query_rows(block),
            },
        }

    devices: list[dict[str, Any]] = []
    roles: dict[str, list[str]] = {}
    for dev in cfg.topology.target_devices:
        roles.setdefault(dev, []).append("target")
    for dev in cfg.topology.drafter_devices:
        roles.setdefault(dev, []).append("drafter")
    for dev, rs in roles.items():
        items: dict[str, int] = {}
        total = 0
        if "target" in rs:
            items.update({f"target_{k}": v for k, v in tgt.items()})
            total += tgt_peak * rs.count("target")
        if "drafter" in rs:
            items.update(fixed)
            items["drafter_step_peak"] = plan.peak
            total += peak
        devices.append(
            {"device": dev, "roles": rs, "items": items, "peak": total, "fits": total <= available}
        )
    sh = est.shapes
    return {
        "device_memory": device_memory,
        "reserve": reserve,
        "available": available,
        "lengths_source": sh.source,
        "anchors_exact": sh.exact_anchors,
        "batches": sh.num_batches,
        "distinct_batch_shapes": len(sh.batches),
        "epochs_scanned": sh.epochs,
        "strategy": cfg.batching.strategy,
        "row_length": sh.row_length,  # packed: the sampler's tokens per row; else None
        "precision": {
            "compute_bytes": est.precision.compute,
            "feature_bytes": est.precision.features,
            "attention": est.precision.backend,
        },
        "drafter": {
            "params": est.drafter.params,
            "fixed_total": fixed_total,
            "per_query_row_bytes": est.per_query_row(),
            "configured": plan_json(plan, peak),
            "unbounded": plan_json(unbounded, unbounded_peak),
            "largest_max_query_rows": largest,
        },
        "target": {"params": est.target.params, "peak": tgt_peak},
        # one checkpoint file: the fp32 drafter weights and AdamW's two moments (the preflight
        # multiplies it by what retention keeps)
        "checkpoint": {
            "bytes": fixed["master_weights_fp32"] + fixed["adamw_moments_fp32"],
            "keep_last": cfg.checkpoint.keep_last,
            "keep_every_steps": cfg.checkpoint.keep_every_steps,
        },
        "devices": devices,
        "fits": all(d["fits"] for d in devices),
        "key": "model.max_query_rows",
    }
