"""The batch shapes the run will produce: the project's own sampler over the configured store.

Every batch of every epoch the schedule covers (`BatchSampler.global_batches`, all ranks) gives
rows, the padded length and, per row, the anchors the objective will draw: min(num_anchors,
eligible positions), eligible = supervised positions whose next token is supervised (the rule
of `trainer.model.masks.eligible_anchors`), counted from the store's loss mask. Without a
readable store the shipped seed-shaped lengths stand in (the same planner and sampler) and every
position but the last counts as eligible: an upper bound, said so in the output.

Packed batches (strategy "packed") are shaped as the trainer collates them: one row per packed
row (`Batch.rows()`), `Batch.max_len` (the fullest row) wide, and a row's anchors are the sum of
its documents' min(num_anchors, eligible): the drafter step draws up to num_anchors per
DOCUMENT and never across a boundary (`masks.sample_anchors`), and a document's eligible
positions are those it has alone (its last position pairs with nothing, as at a row's end).
Under SDPA (CPU) the step lays a packed batch's documents out one per row after the draw (the
dense mask would cost every block the whole row), so there the shape is those rows' and the
packet the packed one (`BatchShape.packet`); flex (CUDA) keeps the packed rows.
The rows' default length is the store's manifest max_length, as the trainer's (`sampler_for`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from trainer.config import TrainConfig
from trainer.memory.costs import Ints, Piece
from trainer.memory.shapes import MemoryEstimateError

if TYPE_CHECKING:
    from trainer.sampler import Batch

SHIPPED_LENGTHS = Path(__file__).resolve().parent.parent / "data" / "samples" / "seed_lengths.npy"


@dataclass(frozen=True)
class BatchShape:
    """One packet: padded length and per-row anchor counts (packet row order).

    `packet`: (rows, seq) of the packed packet itself when the drafter step lays its documents
    out one per row (`seq` and `anchors` are then those rows'); None: the rows are the packet's.
    """

    seq: int
    anchors: tuple[int, ...]
    packet: tuple[int, int] | None = None

    @property
    def rows(self) -> int:
        return len(self.anchors)

    @property
    def packet_tokens(self) -> int:
        """Tokens of the packet the target captures and the queues carry."""
        return self.rows * self.seq if self.packet is None else self.packet[0] * self.packet[1]

    @property
    def width(self) -> int:
        return max(self.anchors, default=0)

    def query_rows(self, block: int) -> int:
        return self.rows * self.width * block


@dataclass(frozen=True)
class Shapes:
    batches: list[BatchShape]  # distinct shapes, all epochs
    source: str  # where lengths and eligible counts came from
    exact_anchors: bool  # False: eligible counts are the length-1 upper bound
    num_batches: int  # before de-duplication
    epochs: int
    row_length: int | None = None  # packed: tokens per row the sampler used; else None


@dataclass(frozen=True)
class StoreFacts:
    """What the estimate reads of the configured store (or the shipped stand-in)."""

    lengths: np.ndarray  # tokens per row (document)
    eligible: np.ndarray  # eligible anchor positions per row
    source: str
    exact: bool  # False: `eligible` is the length-1 upper bound
    max_length: int | None  # the manifest's max_length (None: no store read)


def _eligible_from_store(store: object) -> np.ndarray:
    """Per row: positions i with mask[i] and mask[i+1] (one pass over the mask, chunked)."""
    mask = np.asarray(store.mask)  # type: ignore[attr-defined]
    offsets = np.asarray(store.offsets, dtype=np.int64)  # type: ignore[attr-defined]
    n = len(offsets) - 1
    out = np.zeros(n, dtype=np.int64)
    step = 65_536
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        a, b = int(offsets[lo]), int(offsets[hi])
        m = mask[a:b].astype(bool)
        pair = np.zeros(len(m), dtype=np.int64)
        pair[:-1] = m[:-1] & m[1:]
        ends = offsets[lo + 1 : hi + 1] - a - 1  # a row's last position pairs with the next row
        pair[ends[ends >= 0]] = 0
        starts = offsets[lo:hi] - a
        sums = np.add.reduceat(pair, starts) if len(pair) else np.zeros(hi - lo, np.int64)
        sums[offsets[lo + 1 : hi + 1] == offsets[lo:hi]] = 0
        out[lo:hi] = sums
    return out


def load_lengths_and_eligible(cfg: TrainConfig) -> tuple[np.ndarray, np.ndarray, str, bool]:
    """(lengths, eligible anchors per row, source line, exact?) for the configured store."""
    facts = load_store_facts(cfg)
    return facts.lengths, facts.eligible, facts.source, facts.exact


def load_store_facts(cfg: TrainConfig) -> StoreFacts:
    """Lengths, eligible counts and max_length of the configured store, or the stand-in."""
    from trainer.data.lengths import LengthsError, load_lengths
    from trainer.data.store import StoreError, TokenStore

    path = cfg.resolve(cfg.data.store)
    try:
        store = TokenStore.open(path)
    except (StoreError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        try:
            lengths = load_lengths(SHIPPED_LENGTHS)
        except LengthsError as err:
            raise MemoryEstimateError(f"{SHIPPED_LENGTHS}: {err}") from None
        source = (
            f"data.store {path} not readable ({reason}); the shipped seed-shaped lengths "
            f"({SHIPPED_LENGTHS.name}, {len(lengths)} samples), every position eligible"
        )
        return StoreFacts(lengths, np.maximum(lengths - 1, 0), source, False, None)
    lengths = np.asarray(store.lengths, dtype=np.int64)
    source = f"data.store {path} ({len(lengths)} rows)"
    return StoreFacts(lengths, _eligible_from_store(store), source, True, store.manifest.max_length)


def row_anchors(batch: Batch, anchors: np.ndarray) -> tuple[int, ...]:
    """Per collated row, the anchors the drafter step draws with every one kept: a sample's
    own count, or for a packed row the sum over its documents (`anchors` per sample id)."""
    per_doc = anchors[batch.indices]
    if batch.row_sizes is None:
        return tuple(per_doc.tolist())
    starts = np.concatenate(([0], np.cumsum(batch.row_sizes)[:-1])).astype(np.int64)
    return tuple(np.add.reduceat(per_doc, starts).tolist()) if len(per_doc) else ()


def unpacked_shape(batch: Batch, anchors: np.ndarray, lengths: np.ndarray) -> BatchShape:
    """A packed batch as the SDPA drafter step runs it (`trainer.model.documents`): each
    document with an anchor a row of its own, padded to the longest such document, longest
    first (ties in packet order); a batch without any anchor stays packed (the step's empty
    path). The step attends the rows in groups over narrower contexts: at most this shape's
    attention memory."""
    per_doc = anchors[batch.indices]
    used = per_doc > 0
    if not used.any():
        return BatchShape(batch.max_len, row_anchors(batch, anchors))
    doc_lengths = lengths[batch.indices][used]
    order = np.argsort(-doc_lengths, kind="stable")  # longest first, ties in packet order
    seq = int(doc_lengths.max())
    return BatchShape(seq, tuple(per_doc[used][order].tolist()), (batch.num_rows, batch.max_len))


def step_unpacks(cfg: TrainConfig) -> bool:
    """Whether the drafter step lays packed rows out one document per row: when its attention
    is SDPA (`split_step.bounded_objective_backward`'s default), i.e. no CUDA drafter device,
    the rule `estimate.precision_for` also picks the backend by."""
    return not any(d.startswith("cuda") for d in cfg.topology.drafter_devices)


def batch_shapes(cfg: TrainConfig, *, unpack: bool | None = None) -> Shapes:
    """Distinct packet shapes over every epoch the schedule trains (all data-parallel ranks).

    `unpack` (packed batches): shape them as the step runs them under SDPA, one document per
    row (`unpacked_shape`); None: as the trainer does for this config (`step_unpacks`).
    """
    from trainer.buckets import PlanError, sampler_for
    from trainer.sampler import SamplerError

    facts = load_store_facts(cfg)
    try:
        sampler = sampler_for(
            cfg.batching,
            facts.lengths,
            seed=cfg.seed,
            world_size=len(cfg.topology.drafter_devices),
            max_length=facts.max_length,
        )
    except (PlanError, SamplerError) as exc:
        raise MemoryEstimateError(f"batching: {exc}") from None
    anchors = np.minimum(facts.eligible, cfg.model.num_anchors)
    if unpack is None:
        unpack = step_unpacks(cfg)
    epochs = max(1, math.ceil(cfg.schedule.epochs))
    seen: set[BatchShape] = set()
    total = 0
    for epoch in range(epochs):
        for group in sampler.global_batches(epoch):
            for batch in group:
                total += 1
                if unpack and batch.row_sizes is not None:
                    seen.add(unpacked_shape(batch, anchors, facts.lengths))
                else:
                    seen.add(BatchShape(batch.max_len, row_anchors(batch, anchors)))
    return Shapes(
        sorted(seen, key=lambda s: (s.seq, s.anchors, s.packet or (0, 0))),
        facts.source,
        facts.exact,
        total,
        epochs,
        sampler.row_length,
    )


def pieces(
    shape: BatchShape, block: int, max_query_rows: int | None, *, widest_run: bool = False
) -> Iterator[Piece]:
    """The micro-steps of `trainer.model.split_step.split_pieces`, as shapes (torch-free twin,
    tested equal): whole rows grouped while rows x group width x block fits, else a row cut into
    runs of max_query_rows // block anchors; all-padding columns dropped.

    `widest_run`: of a cut row's runs yield only the first (the widest), which is all a peak
    needs; without it a 1-block budget walks every block of every batch.
    """
    rows, width, seq = shape.rows, shape.width, shape.seq
    # unpacked documents: every piece may project all of the packet's rows (an upper bound)
    packed = shape.packet[0] * shape.packet[1] if shape.packet is not None else 0
    if max_query_rows is None or rows * width * block <= max_query_rows:
        yield Piece(rows, seq, width, packed)
        return
    per_row = shape.anchors
    per_piece = max(1, max_query_rows // block)
    start = 0
    while start < rows:
        end, group_width = start, 0
        while end < rows:
            w = max(group_width, per_row[end])
            if (end - start + 1) * w * block > max_query_rows:
                break
            end, group_width = end + 1, w
        if end > start:
            if group_width > 0:
                yield Piece(end - start, seq, group_width, packed)
            start = end
            continue
        for a in range(0, per_row[start], per_piece):
            yield Piece(1, seq, min(per_piece, per_row[start] - a), packed)
            if widest_run:
                break
        start += 1


@dataclass(frozen=True)
class ShapeTable:
    """Batch shapes as arrays, one entry per shape in the given order (`Shapes.batches`): the
    estimate prices every shape's pieces at once (`piece_table`) instead of one at a time."""

    seq: Ints
    rows: Ints
    width: Ints
    packed_tokens: Ints  # `Piece.packed_tokens` of the shape's pieces (0: not unpacked)
    packet_tokens: Ints  # `BatchShape.packet_tokens`
    starts: Ints  # where each shape's per-row anchors begin in `anchors`
    anchors: Ints  # every shape's per-row anchor counts, end to end

    @classmethod
    def of(cls, shapes: Sequence[BatchShape]) -> ShapeTable:
        rows = np.fromiter((s.rows for s in shapes), np.int64, len(shapes))
        packed = np.fromiter(
            (s.packet[0] * s.packet[1] if s.packet else 0 for s in shapes), np.int64, len(shapes)
        )
        anchors = np.fromiter((a for s in shapes for a in s.anchors), np.int64, int(rows.sum()))
        starts = np.concatenate(([0], np.cumsum(rows)[:-1])).astype(np.int64)
        width = np.fromiter((s.width for s in shapes), np.int64, len(shapes))
        seq = np.fromiter((s.seq for s in shapes), np.int64, len(shapes))
        return cls(
            seq, rows, width, packed, np.where(packed > 0, packed, rows * seq), starts, anchors
        )

    def __len__(self) -> int:
        return len(self.rows)


@dataclass(frozen=True)
class PieceTable:
    """Pieces as arrays: piece i is `Piece(rows[i], seq, width[i], packed_tokens)` of the
    table's shape `shape[i]` (in no particular order)."""

    shape: Ints
    rows: Ints
    width: Ints


def piece_table(table: ShapeTable, block: int, max_query_rows: int | None) -> PieceTable:
    """Every shape's `pieces(shape, block, max_query_rows, widest_run=True)`, all shapes at
    once (tested equal): the same greedy grouping, stepped one row position at a time over
    every shape that has that row. A shape that fits whole is one piece; a row that alone does
    not fit yields its widest run only."""
    whole = np.ones(len(table), dtype=bool)
    if max_query_rows is not None:
        whole = table.rows * table.width * block <= max_query_rows
    kept = np.flatnonzero(whole)
    out_shape, out_rows, out_width = [kept], [table.rows[kept]], [table.width[kept]]
    split = np.flatnonzero(~whole)
    if max_query_rows is not None and len(split):
        per_piece = max(1, max_query_rows // block)
        rows, starts = table.rows[split], table.starts[split]
        n = np.zeros(len(split), dtype=np.int64)  # rows in each shape's open group
        group_width = np.zeros(len(split), dtype=np.int64)
        for r in range(int(rows.max())):
            live = np.flatnonzero(rows > r)
            a = table.anchors[starts[live] + r]
            n_live, g_live = n[live], group_width[live]
            w = np.maximum(g_live, a)
            fits = (n_live + 1) * w * block <= max_query_rows
            close = ~fits & (n_live > 0) & (g_live > 0)  # the open group ends before row r
            alone = a * block <= max_query_rows  # row r then opens the next group ...
            run = ~fits & ~alone  # ... or is cut into runs: its first (widest) one
            out_shape += [split[live[close]], split[live[run]]]
            out_rows += [n_live[close], np.ones(int(run.sum()), dtype=np.int64)]
            out_width += [g_live[close], np.minimum(per_piece, a[run])]
            n[live] = np.where(fits, n_live + 1, alone.astype(np.int64))
            group_width[live] = np.where(fits, w, np.where(alone, a, 0))
        tail = np.flatnonzero((n > 0) & (group_width > 0))
        out_shape.append(split[tail])
        out_rows.append(n[tail])
        out_width.append(group_width[tail])
    return PieceTable(
        np.concatenate(out_shape), np.concatenate(out_rows), np.concatenate(out_width)
    )
