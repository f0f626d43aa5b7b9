"""Batch sampler: which samples train together, in what order, on which rank. numpy only.

Strategies (all pack greedily under a token budget, so no batch ever pads past it):

- ``bucketed`` (default): per epoch, shuffle each length bucket with an RNG keyed by
  (seed, epoch, bucket), pack greedily inside the bucket (add the next sample while
  (size + 1) * longest <= token_budget and size < max_batch), then shuffle the batch order.
  Batch composition changes every epoch; padding stays close to the planner's prediction.
- ``sorted``: the seed's original. Length-sorted once (ties broken by seed), packed once;
  only the batch order changes per epoch, so composition is static.
- ``random``: a fresh permutation per epoch, packed greedily. Diverse but padding-heavy.
- ``pool-sort``: a fresh permutation cut into pools of ``pool_size``; each pool is sorted and
  packed (the Hugging Face "megabatch" idea under a token budget).
- ``packed``: padding-free. A fresh permutation per epoch is laid into rows of ``row_length``
  tokens (several documents per row, each keeping its own positions and attention): first-fit
  over the ``PACK_OPEN_ROWS`` most recently opened rows, in shuffled order (the oldest open row
  closes when none fits), which fills rows ~97-99 % where next-fit fills ~82 %
  and keeps full-shuffle diversity. Closed rows are batched in order while
  (rows + 1) * row_length <= token_budget and the documents stay <= max_batch (``max_batch``
  bounds documents, as it bounds samples elsewhere: the drafter's work grows with documents x
  anchors). A row holds at most max_batch documents. `Batch.row_sizes` says which of
  `Batch.indices` share a row; rows are padded only at their end, to the batch's fullest row.

Every epoch is a pure function of (lengths, config, seed, epoch): each purpose draws from its own
Philox stream keyed by a SeedSequence, never from global RNG state, so any machine and any worker
count give the same batches. The sampler keeps no position: the resume position is the global
micro-batch sequence number `trainer.pipeline.plan.BatchPlan` numbers these epochs with, checked
against this sampler's `fingerprint()` (`check_state`).

Sharding policy (world_size > 1): batches are dealt in groups of world_size. Inside each bucket
(strategy segment) consecutive batches form a group, so the ranks of one step train on the same
bucket and none waits on a long-bucket peer. The few leftover batches of all buckets form mixed
groups. To make the total a multiple of world_size without dropping samples, the largest batches
are split in two (at most world_size - 1 splits per epoch; a split batch is smaller, so still
within budget). Only when every batch already holds a single sample (fewer samples than the equal
share needs) are the last ``total % world_size`` batches dropped for that epoch; `dropped()`
reports them. Group order is shuffled per epoch; rank r takes the r-th batch of every group.
"""

from __future__ import annotations

import heapq
import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from trainer.config import STRATEGIES, Strategy
from trainer.data.lengths import LengthsError, as_lengths
from trainer.sampler_state import config_fingerprint, sampler_config, state_mismatch

# Stream purposes: each gets an independent Philox stream for a given (seed, epoch).
_BUCKET_SHUFFLE, _BATCH_ORDER, _SORT_TIES, _RANDOM_PERM, _POOL_PERM, _HOLDOUT, _PACK_PERM = range(7)

PACK_OPEN_ROWS = 16
"""Rows the packer keeps open (first-fit window). On the tiny config's 3,000 lengths (row 160,
budget 1,024): padding efficiency 91.2 % at 4, 94.3 % at 8, 96.1 % at 16, 97.0 % at 32, with
pair repeat 0.40 % at 8, 0.43 % at 16, 0.45 % at 32 (random batching: 0.26 %); on 900k
seed-shaped lengths (row 8,192) rows fill 97.8 % at 8, 98.4 % at 16, in 0.7 s per epoch. Not
32: fuller rows hold more documents, so more anchors per packed row, and at 32 a packed
batch's drafter peak passed the padded strategies' (tests/memory/test_memory_packed.py).
Part of the fingerprint."""


class SamplerWarning(UserWarning):
    """A legal configuration that does not do what its name promises (see `BatchSampler.warnings`)."""


def pool_sort_warning(num_samples: int, pool_size: int) -> str | None:
    """The one-line warning for a pool-sort pool that holds the whole data set, else None."""
    if pool_size < num_samples:
        return None
    return (
        f"pool-sort: pool_size {pool_size:,} >= the {num_samples:,} samples, so each epoch is one "
        "sorted pool: the 'sorted' strategy with reshuffled ties (the same length neighbours "
        "share batches every epoch); use a pool well below the sample count "
        f"(e.g. {max(1, min(3200, num_samples // 4)):,})"
    )


class SamplerError(ValueError):
    """Invalid sampler input or state; the message names the argument, sample or key."""


@dataclass(frozen=True)
class Batch:
    """One step's samples for one rank, collated as `num_rows` rows of `max_len` tokens.

    One sample per row (`row_sizes` None) except for the packed strategy, whose rows hold several
    documents: `row_sizes[r]` consecutive ids of `indices` share row r, in order, and `max_len` is
    the fullest row's token count (rows are padded only at their end). `padded_tokens` is then
    `max_len * num_rows` either way.
    """

    indices: np.ndarray  # int64 sample ids (packed: row by row, in row order)
    bucket: int
    max_len: int  # the collated width: longest sample, or fullest packed row
    real_tokens: int
    row_sizes: np.ndarray | None = None  # packed: int64 documents per row (sums to len(indices))

    @property
    def num_rows(self) -> int:
        return len(self.indices) if self.row_sizes is None else len(self.row_sizes)

    @property
    def padded_tokens(self) -> int:
        return self.max_len * self.num_rows

    def rows(self) -> list[np.ndarray]:
        """The sample ids of each collated row (one id per row unless packed)."""
        if self.row_sizes is None:
            return [self.indices[i : i + 1] for i in range(len(self.indices))]
        return np.split(self.indices, np.cumsum(self.row_sizes)[:-1])


def rng_for(seed: int, *key: int) -> np.random.Generator:
    """An independent counter-based generator for (seed, *key): no global state, portable."""
    return np.random.Generator(np.random.Philox(np.random.SeedSequence([seed, *key])))


def greedy_batch_sizes(
    ordered: np.ndarray, segment: np.ndarray, token_budget: int, max_batch: int
) -> np.ndarray:
    """Sizes of the batches the greedy packer cuts from `ordered` lengths (int64).

    A batch starting at s grows while (size + 1) * max(batch) <= token_budget, size < max_batch and
    the next sample lies in the same segment (bucket or pool). Since (j + 1) * running max grows with
    j, the reach of every start is computed for all starts at once (one vector pass per extra
    sample); only following the chain of starts is sequential, one step per batch.
    """
    n = len(ordered)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    x = ordered.astype(np.int64, copy=False)
    change = np.flatnonzero(segment[1:] != segment[:-1]) + 1
    seg_end = np.repeat(np.append(change, n), np.diff(np.concatenate(([0], change, [n]))))
    room = seg_end - np.arange(n)
    reach = np.ones(n, dtype=np.int64)
    active = np.arange(n)
    run_max = x.copy()
    for j in range(1, max_batch):
        active = active[active + j < n]
        if active.size == 0:
            break
        run_max_a = np.maximum(run_max[active], x[active + j])
        ok = ((j + 1) * run_max_a <= token_budget) & (room[active] > j)
        active = active[ok]
        run_max[active] = run_max_a[ok]
        reach[active] += 1
    sizes = []
    s = 0
    reach_list = reach.tolist()
    while s < n:
        k = reach_list[s]
        sizes.append(k)
        s += k
    return np.asarray(sizes, dtype=np.int64)


def pack_rows(
    ordered: np.ndarray, row_length: int, open_rows: int, max_docs: int
) -> tuple[np.ndarray, np.ndarray]:
    """Lay `ordered` lengths into rows of at most `row_length` tokens and `max_docs` documents.

    First-fit over the (at most `open_rows`) open rows, oldest first; when none has room a new
    row opens and, if `open_rows` are open already, the oldest closes. A row also closes as soon
    as no sample could still fit (room below the shortest length) or it holds `max_docs`. Rows
    come out in closing order (then the still-open ones, oldest first).

    Returns:
        (order, row_sizes): positions into `ordered`, row by row, and the documents per row.
    """
    xs = ordered.astype(np.int64, copy=False).tolist()
    shortest = min(xs) if xs else 0
    rows: list[list[int]] = []
    room: list[int] = []
    done: list[list[int]] = []
    for i, length in enumerate(xs):
        for r, left in enumerate(room):
            if left >= length:
                rows[r].append(i)
                room[r] = left - length
                if room[r] < shortest or len(rows[r]) >= max_docs:
                    done.append(rows.pop(r))
                    room.pop(r)
                break
        else:
            if len(rows) == open_rows:
                done.append(rows.pop(0))
                room.pop(0)
            rows.append([i])
            room.append(row_length - length)
            if room[-1] < shortest or max_docs == 1:
                done.append(rows.pop())
                room.pop()
    done.extend(rows)
    order = np.fromiter(itertools.chain.from_iterable(done), dtype=np.int64, count=len(xs))
    return order, np.fromiter((len(r) for r in done), dtype=np.int64, count=len(done))


def batch_rows(row_docs: np.ndarray, rows_per_batch: int, max_batch: int) -> np.ndarray:
    """Rows per batch when consecutive rows are batched while the batch keeps at most
    `rows_per_batch` rows and `max_batch` documents (every row holds <= max_batch)."""
    sizes: list[int] = []
    rows = docs = 0
    for d in row_docs.tolist():
        if rows and (rows == rows_per_batch or docs + d > max_batch):
            sizes.append(rows)
            rows = docs = 0
        rows, docs = rows + 1, docs + d
    if rows:
        sizes.append(rows)
    return np.asarray(sizes, dtype=np.int64)


def bucket_of(lengths: np.ndarray, boundaries: Sequence[int]) -> np.ndarray:
    """Bucket id per sample for half-open buckets [b_k, b_k+1)."""
    return np.searchsorted(np.asarray(boundaries, dtype=np.int64), lengths, side="right") - 1


def check_boundaries(lengths: np.ndarray, boundaries: Sequence[int]) -> list[int]:
    """Validate K+1 strictly increasing edges covering every length; return them as ints."""
    try:
        edges = [int(b) for b in boundaries]
    except (TypeError, ValueError):
        raise SamplerError(f"boundaries must be integers, got {list(boundaries)!r}") from None
    if len(edges) < 2:
        raise SamplerError(f"boundaries need at least 2 edges (1 bucket), got {edges}")
    if any(b >= c for b, c in itertools.pairwise(edges)):
        raise SamplerError(f"boundaries must be strictly increasing, got {edges}")
    lo, hi = int(lengths.min()), int(lengths.max())
    if edges[0] > lo or edges[-1] <= hi:
        bad = int(np.argmin(lengths)) if edges[0] > lo else int(np.argmax(lengths))
        raise SamplerError(
            f"sample {bad} (length {int(lengths[bad])}) lies outside boundaries "
            f"[{edges[0]}, {edges[-1]}): first edge must be <= {lo}, last edge > {hi}"
        )
    return edges


def check_row_length(lengths: np.ndarray, row_length: int | None, token_budget: int) -> int:
    """The packed strategy's row length: `row_length` validated against the longest sample and
    the budget, or the longest sample's length when None."""
    longest = int(np.argmax(lengths))
    if row_length is None:
        return int(lengths[longest])
    if not isinstance(row_length, int | np.integer) or row_length < 1:
        raise SamplerError(f"row_length must be an integer >= 1, got {row_length!r}")
    if row_length < lengths[longest]:
        raise SamplerError(
            f"row_length {row_length} is shorter than sample {longest} "
            f"({int(lengths[longest])} tokens): a row must hold the longest sample"
        )
    if row_length > token_budget:
        raise SamplerError(
            f"row_length {row_length} is more than token_budget {token_budget}: "
            "a batch holds at least one row"
        )
    return int(row_length)


def holdout_rows(num_rows: int, count: int, seed: int) -> np.ndarray:
    """The held-out row ids (``[eval] holdout_rows``): `count` distinct ids of `num_rows`, int64.

    A prefix of one Philox permutation keyed by (seed, holdout purpose): a pure function of the
    three numbers, and prefix-stable (the first 50 of a 100-row holdout are the 50-row holdout).
    """
    if not 0 <= count < num_rows:
        raise SamplerError(
            f"holdout of {count} rows must leave training rows: the store has {num_rows}"
        )
    return rng_for(seed, _HOLDOUT).permutation(num_rows)[:count].astype(np.int64)


class BatchSampler:
    """Deterministic, sharded batches under a token budget (see module docstring): every epoch is
    a pure function of (seed, epoch), recomputed on each call (callers that need an epoch more
    than once keep it: `BatchPlan` does).

    Args:
        lengths: tokens per sample (any integer array; validated, copied as int64).
        strategy: "bucketed", "sorted", "random", "pool-sort" or "packed".
        boundaries: K+1 bucket edges for "bucketed" (None: one bucket); ignored otherwise.
        token_budget: max padded tokens per batch (batch size * longest sample; packed: rows *
            row_length).
        max_batch: max samples per batch.
        seed: non-negative base seed; epoch e of seed s is the same everywhere.
        rank, world_size: this process's shard of every step.
        pool_size: samples per sorted pool for "pool-sort".
        row_length: tokens per row for "packed" (None: the longest sample); at least the longest
            sample and at most token_budget. Ignored by the other strategies.
        exclude: sample ids that never enter a batch (the held-out rows); empty = none. The
            others are ordered exactly as if the excluded ones were drawn and then skipped.

    Raises:
        SamplerError: bad argument, or a sample longer than the token budget (named by index).

    Warns:
        SamplerWarning: legal settings that defeat their purpose (a pool-sort pool holding every
            sample is the sorted strategy); the same lines are kept in ``warnings``.
    """

    def __init__(
        self,
        lengths: np.ndarray | Sequence[int],
        *,
        strategy: Strategy = "bucketed",
        boundaries: Sequence[int] | None = None,
        token_budget: int,
        max_batch: int,
        seed: int,
        rank: int = 0,
        world_size: int = 1,
        pool_size: int = 3200,
        exclude: np.ndarray | Sequence[int] | None = None,
        row_length: int | None = None,
    ) -> None:
        try:
            self.lengths = as_lengths(np.asarray(lengths))
        except LengthsError as exc:
            raise SamplerError(str(exc)) from None
        self.lengths.setflags(write=False)
        if strategy not in STRATEGIES:
            raise SamplerError(f"strategy must be one of {', '.join(STRATEGIES)}; got {strategy!r}")
        for name, value, low in (
            ("token_budget", token_budget, 1),
            ("max_batch", max_batch, 1),
            ("world_size", world_size, 1),
            ("pool_size", pool_size, 1),
            ("seed", seed, 0),
        ):
            if not isinstance(value, int | np.integer) or value < low:
                raise SamplerError(f"{name} must be an integer >= {low}, got {value!r}")
        if not 0 <= rank < world_size:
            raise SamplerError(f"rank must be in [0, {world_size}), got {rank}")
        n = len(self.lengths)
        excluded = np.unique(np.asarray([] if exclude is None else exclude, dtype=np.int64))
        if excluded.size and (excluded[0] < 0 or excluded[-1] >= n):
            bad = int(excluded[0] if excluded[0] < 0 else excluded[-1])
            raise SamplerError(f"excluded sample {bad} is outside the {n} samples")
        self.excluded = excluded
        self._train = np.ones(n, dtype=bool)
        self._train[excluded] = False
        longest = int(np.argmax(self.lengths))
        if self.lengths[longest] > token_budget:
            raise SamplerError(
                f"sample {longest} has {int(self.lengths[longest])} tokens, more than "
                f"token_budget {token_budget}: raise the budget or truncate at import (--max-length)"
            )
        if n - excluded.size < world_size:
            held = f" ({excluded.size} held out)" if excluded.size else ""
            raise SamplerError(
                f"{n - excluded.size} samples{held} cannot give each of {world_size} ranks a batch"
            )
        self.row_length = (
            check_row_length(self.lengths, row_length, token_budget)
            if strategy == "packed"
            else None
        )
        self.strategy: str = strategy
        self.token_budget, self.max_batch, self.seed = int(token_budget), int(max_batch), int(seed)
        self.rank, self.world_size, self.pool_size = int(rank), int(world_size), int(pool_size)
        if strategy == "bucketed":
            edges = [int(self.lengths.min()), int(self.lengths.max()) + 1]
            self.boundaries = check_boundaries(self.lengths, boundaries or edges)
        else:
            self.boundaries = [int(self.lengths.min()), int(self.lengths.max()) + 1]
        self.num_buckets = len(self.boundaries) - 1 if strategy == "bucketed" else 1
        bucket = bucket_of(self.lengths, self.boundaries)
        order = np.argsort(bucket, kind="stable")
        order = order[self._train[order]]
        bucket = bucket[self._train]
        counts = np.bincount(bucket, minlength=self.num_buckets)
        self._members = np.split(order, np.cumsum(counts)[:-1])
        self.fingerprint_config: dict[str, object] = sampler_config(
            lengths=self.lengths,
            strategy=self.strategy,
            boundaries=self.boundaries,
            token_budget=self.token_budget,
            max_batch=self.max_batch,
            seed=self.seed,
            world_size=self.world_size,
            pool_size=self.pool_size,
            row_length=self.row_length,
            pack_open_rows=PACK_OPEN_ROWS,
            excluded=self.excluded,
        )
        note = pool_sort_warning(len(self.lengths), self.pool_size)
        self.warnings: tuple[str, ...] = (note,) if strategy == "pool-sort" and note else ()
        for text in self.warnings:  # reaches the trainer's log (stderr) as well as callers
            warnings.warn(text, SamplerWarning, stacklevel=2)

    # ----- epoch construction -------------------------------------------------------------
    def _global(self, epoch: int) -> tuple[list[list[Batch]], np.ndarray]:
        """All ranks' batches for `epoch` as step groups of world_size, plus dropped sample ids."""
        if epoch < 0:
            raise SamplerError(f"epoch must be >= 0, got {epoch}")
        order = rng_for(self.seed, epoch, _BATCH_ORDER)
        if self.row_length is not None:
            ids = rng_for(self.seed, epoch, _PACK_PERM).permutation(len(self.lengths))
            return packed_groups(
                self.lengths,
                ids[self._train[ids]],
                self.row_length,
                token_budget=self.token_budget,
                max_batch=self.max_batch,
                world_size=self.world_size,
                order=order,
            )
        ids, seg = ordered_ids(
            self.strategy,
            self.lengths,
            self._members,
            self._train,
            self.seed,
            epoch,
            self.pool_size,
        )
        return padded_groups(
            self.lengths,
            ids,
            seg,
            token_budget=self.token_budget,
            max_batch=self.max_batch,
            world_size=self.world_size,
            bucketed=self.strategy == "bucketed",
            order=order,
        )

    def global_batches(self, epoch: int) -> list[list[Batch]]:
        """Every rank's batches for `epoch`: one list of world_size batches per step."""
        return self._global(epoch)[0]

    def dropped(self, epoch: int) -> np.ndarray:
        """Sample ids left out of `epoch` to keep rank step counts equal (almost always empty)."""
        return self._global(epoch)[1]

    def epoch_batches(self, epoch: int) -> list[Batch]:
        """This rank's batches for `epoch`, in step order; a pure function of (seed, epoch)."""
        return [group[self.rank] for group in self._global(epoch)[0]]

    def steps_per_epoch(self, epoch: int = 0) -> int:
        """Steps (batches per rank) in `epoch`; equal on every rank."""
        return len(self._global(epoch)[0])

    # ----- resume check ---------------------------------------------------------------------
    def fingerprint(self) -> str:
        """sha256-16 of the lengths and every setting that shapes the batches (not the rank)."""
        return config_fingerprint(self.fingerprint_config)

    def check_state(self, state: Mapping[str, object]) -> None:
        """Refuse a saved sampler state (`BatchPlan.state_dict`) from other data or settings:
        SamplerError naming each setting that differs."""
        problem = state_mismatch(state, self.fingerprint_config)
        if problem is not None:
            raise SamplerError(problem)


# ----- epoch construction (pure) ------------------------------------------------------------
def ordered_ids(
    strategy: str,
    lengths: np.ndarray,
    members: list[np.ndarray],
    keep: np.ndarray,
    seed: int,
    epoch: int,
    pool_size: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Sample ids in packing order and the segment (bucket or pool) of each position, for the
    padded strategies. `members`: each bucket's training ids; `keep`: True for training ids.

    Excluded ids are dropped from the full-size draws, so the others keep their order."""
    n = len(lengths)
    if strategy == "bucketed":
        parts = [
            m[rng_for(seed, epoch, _BUCKET_SHUFFLE, k).permutation(len(m))]
            for k, m in enumerate(members)
        ]
        ids = np.concatenate(parts)
        seg = np.repeat(np.arange(len(members)), [len(p) for p in parts])
        return ids, seg
    if strategy == "sorted":  # static: the tie-break depends on the seed only
        ties = rng_for(seed, _SORT_TIES).permutation(n)
        ids = np.lexsort((ties, lengths))
        ids = ids[keep[ids]]
        return ids, np.zeros(len(ids), dtype=np.int64)
    if strategy == "random":
        ids = rng_for(seed, epoch, _RANDOM_PERM).permutation(n)
        ids = ids[keep[ids]]
        return ids, np.zeros(len(ids), np.int64)
    perm = rng_for(seed, epoch, _POOL_PERM).permutation(n)
    perm = perm[keep[perm]]
    pool = np.arange(len(perm)) // pool_size
    return perm[np.lexsort((lengths[perm], pool))], pool


def padded_groups(
    lengths: np.ndarray,
    ids: np.ndarray,
    seg: np.ndarray,
    *,
    token_budget: int,
    max_batch: int,
    world_size: int,
    bucketed: bool,
    order: np.random.Generator,
) -> tuple[list[list[Batch]], np.ndarray]:
    """The padded strategies' epoch: `ids` (in packing order, `seg` per position) cut greedily
    into batches, equalized to a multiple of world_size, dealt into step groups (per segment
    first, then the leftovers mixed) and the groups shuffled by `order`. Returns the groups
    and the dropped sample ids."""
    sizes = greedy_batch_sizes(lengths[ids], seg, token_budget, max_batch)
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    pieces = [(int(seg[s]), ids[s : s + k]) for s, k in zip(starts, sizes, strict=True)]
    pieces, dropped = _equalize(pieces, world_size)
    w = world_size
    full: list[list[tuple[int, np.ndarray]]] = []
    leftover: list[tuple[int, np.ndarray]] = []
    i = 0
    while i < len(pieces):  # pieces are contiguous per segment
        j = i
        while j < len(pieces) and pieces[j][0] == pieces[i][0]:
            j += 1
        whole = i + (j - i) // w * w
        full.extend(pieces[g : g + w] for g in range(i, whole, w))
        leftover.extend(pieces[whole:j])
        i = j
    full.extend(leftover[g : g + w] for g in range(0, len(leftover), w))
    flat = [piece for group in full for piece in group]
    sizes = np.fromiter((len(p) for _, p in flat), dtype=np.int64, count=len(flat))
    starts = np.concatenate(([0], np.cumsum(sizes)[:-1]))
    ls = lengths[np.concatenate([p for _, p in flat])]
    maxes = np.maximum.reduceat(ls, starts).tolist()
    reals = np.add.reduceat(ls, starts).tolist()
    batches = [
        Batch(p, s if bucketed else 0, m, r)
        for (s, p), m, r in zip(flat, maxes, reals, strict=True)
    ]
    perm = order.permutation(len(full)).tolist()
    groups = [batches[g * w : (g + 1) * w] for g in perm]
    return groups, dropped


def packed_groups(
    lengths: np.ndarray,
    ids: np.ndarray,
    row_length: int,
    *,
    token_budget: int,
    max_batch: int,
    world_size: int,
    order: np.random.Generator,
) -> tuple[list[list[Batch]], np.ndarray]:
    """The packed strategy's epoch: `ids` (shuffled) laid into rows, rows batched, equalized,
    dealt in groups of world_size and the groups shuffled by `order`. Returns the groups and
    the dropped sample ids."""
    pos, row_docs = pack_rows(lengths[ids], row_length, PACK_OPEN_ROWS, max_batch)
    rows = np.split(ids[pos], np.cumsum(row_docs)[:-1])
    per_batch = batch_rows(row_docs, token_budget // row_length, max_batch)
    starts = np.concatenate(([0], np.cumsum(per_batch)[:-1])).tolist()
    pieces = [rows[s : s + k] for s, k in zip(starts, per_batch.tolist(), strict=True)]
    pieces, dropped = _equalize_packed(pieces, world_size)
    batches = []
    for piece in pieces:
        fills = [int(lengths[r].sum()) for r in piece]
        sizes = np.fromiter((len(r) for r in piece), dtype=np.int64, count=len(piece))
        batches.append(Batch(np.concatenate(piece), 0, max(fills), sum(fills), sizes))
    w = world_size
    perm = order.permutation(len(batches) // w).tolist()
    return [batches[g * w : (g + 1) * w] for g in perm], dropped


P = TypeVar("P")


def _split_largest(
    pieces: Sequence[P],
    world_size: int,
    size: Callable[[P], int],
    halve: Callable[[P], tuple[P, P]],
) -> tuple[list[P], int]:
    """Halve the piece of the largest `size` (halves included) until the count is a multiple
    of world_size or every piece has size 1; each tail lands right after its head. Returns the
    pieces and the count still missing (0 unless every piece is down to size 1)."""
    deficit = -len(pieces) % world_size
    store = dict(enumerate(pieces))
    after: dict[int, list[int]] = {}  # piece id -> the tails split off it, nearest first
    heap = [(-size(p), i, i) for i, p in store.items()]
    heapq.heapify(heap)
    fresh = len(store)
    while deficit and heap and -heap[0][0] > 1:
        _, slot, i = heapq.heappop(heap)
        head, tail = halve(store[i])
        store[i], store[fresh] = head, tail
        after.setdefault(i, []).insert(0, fresh)
        heapq.heappush(heap, (-size(head), slot, i))
        heapq.heappush(heap, (-size(tail), slot, fresh))
        fresh += 1
        deficit -= 1

    def walk(i: int) -> Iterator[P]:
        yield store[i]
        for t in after.get(i, []):
            yield from walk(t)

    return [p for i in range(len(pieces)) for p in walk(i)], deficit


def _equalize(
    pieces: list[tuple[int, np.ndarray]], world_size: int
) -> tuple[list[tuple[int, np.ndarray]], np.ndarray]:
    """Split the largest batches until the count is a multiple of world_size (see module doc)."""

    Piece = tuple[int, np.ndarray]

    def halve(piece: Piece) -> tuple[Piece, Piece]:
        seg, ids = piece
        half = (len(ids) + 1) // 2
        return (seg, ids[:half]), (seg, ids[half:])

    out, deficit = _split_largest(pieces, world_size, lambda p: len(p[1]), halve)
    if deficit == 0:
        return out, np.zeros(0, dtype=np.int64)
    cut = len(out) % world_size  # every batch is a single sample: drop the last `cut`
    dropped = np.concatenate([p for _, p in out[len(out) - cut :]])
    return out[: len(out) - cut], dropped


def _equalize_packed(
    pieces: list[list[np.ndarray]], world_size: int
) -> tuple[list[list[np.ndarray]], np.ndarray]:
    """`_equalize` for packed batches (lists of rows): the batch with the most documents is
    split, by rows when it has several (the first half keeps the extra row), else its one row
    by documents (both halves are shorter rows, so still within row_length and budget)."""

    def halve(rows: list[np.ndarray]) -> tuple[list[np.ndarray], list[np.ndarray]]:
        if len(rows) > 1:
            half = (len(rows) + 1) // 2
            return rows[:half], rows[half:]
        cut = (len(rows[0]) + 1) // 2
        return [rows[0][:cut]], [rows[0][cut:]]

    out, deficit = _split_largest(pieces, world_size, lambda p: sum(len(r) for r in p), halve)
    if deficit == 0:
        return out, np.zeros(0, dtype=np.int64)
    cut = len(out) % world_size  # every batch is a single document: drop the last `cut`
    dropped = np.concatenate([r for p in out[len(out) - cut :] for r in p])
    return out[: len(out) - cut], dropped
