"""Synthetic token stores for tests and the demo (`python -m trainer.data synth`).

Lengths come from a real distribution (seed-shaped or a `.npy`/store), so bucketing and
throughput behave as on real data. Tokens must be *learnable*, or a demo cannot show a falling
loss: every row is a walk on a seeded sparse Markov chain (each token has 4 successors with
probabilities 0.70/0.15/0.10/0.05, plus a 2% jump to a uniform token). A bigram model reaches
~1.3 nats/token on held-out rows instead of ln V (6.2 nats at V=512); predicting k tokens ahead
(what a block drafter does) gets harder smoothly with k. Each row starts with a prompt (10-50% of its length,
mask 0) followed by the response (mask 1, at least 2 tokens so it can hold an anchor).

Reserved ids: the top `reserved_top` ids of the vocabulary (default 8: V-8..V-1) and the mask
token (default V-1) are never emitted, so the model may use them as mask/pad tokens. They are
listed in the manifest (`reserved_token_ids`, `mask_token_id`) and checked by `open(verify=True)`.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from trainer.data.errors import InputError
from trainer.data.store import Manifest, StoreWriter, check_target, sha256_file

SUCCESSOR_PROBS = (0.70, 0.15, 0.10, 0.05)
JUMP_PROB = 0.02
PROMPT_FRACTION = (0.10, 0.50)
MIN_ROW = 3  # one prompt token + two supervised tokens (one anchor pair)
MIN_ALPHABET = 8
CHUNK_ELEMENTS = 1 << 22  # rows x longest row generated per vectorised chunk
_TAG_ROWS, _TAG_CHAIN, _TAG_TOKENS = 1, 2, 3


def _rng(seed: int, tag: int) -> np.random.Generator:
    """Independent, platform-stable streams per purpose, so changing --rows never reshuffles tokens."""
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, tag])))


def reserved_token_ids(vocab_size: int, reserved_top: int, mask_token_id: int | None) -> list[int]:
    """Ids the generator never emits: the top `reserved_top` ids plus the mask token."""
    ids = set(range(vocab_size - reserved_top, vocab_size))
    if mask_token_id is not None:
        ids.add(mask_token_id)
    return sorted(ids)


@dataclass(frozen=True)
class MarkovChain:
    """Sparse first-order chain over `alphabet` (the emittable ids)."""

    alphabet: np.ndarray  # int32 ids that may appear
    successors: np.ndarray  # [len(alphabet), K] indices into alphabet
    cumulative: np.ndarray  # [K] cumulative successor probabilities

    @classmethod
    def build(cls, alphabet: np.ndarray, seed: int) -> MarkovChain:
        rng = _rng(seed, _TAG_CHAIN)
        k = len(SUCCESSOR_PROBS)
        n = alphabet.size
        # Successor = state + offset (mod n) with k distinct non-zero offsets per state, so there
        # are no self-loops; redraw the (rare) rows that drew a repeated offset.
        offsets = rng.integers(1, n, size=(n, k))
        while True:
            ordered = np.sort(offsets, axis=1)
            dup = (ordered[:, 1:] == ordered[:, :-1]).any(axis=1)
            if not dup.any():
                break
            offsets[dup] = rng.integers(1, n, size=(int(dup.sum()), k))
        successors = (np.arange(n)[:, None] + offsets) % n
        return cls(alphabet.astype(np.int32), successors, np.cumsum(SUCCESSOR_PROBS))

    def walk(self, rows: int, width: int, rng: np.random.Generator) -> np.ndarray:
        """[rows, width] token ids, each row an independent walk from a uniform start.

        Time-major buffers keep each step's column contiguous; the sequential part is four
        in-place numpy calls per position, so the cost is ~width calls per chunk, not per row.
        """
        n = self.alphabet.size
        k = self.successors.shape[1]
        flat = self.successors.ravel()
        start = rng.integers(0, n, size=rows)
        pick = rng.random((width, rows), dtype=np.float32)
        jumps = rng.random((width, rows), dtype=np.float32) < JUMP_PROB
        targets = rng.integers(0, n, size=(width, rows))
        slot = np.searchsorted(self.cumulative.astype(np.float32), pick, side="right")
        np.minimum(slot, k - 1, out=slot)
        states = np.empty((width, rows), dtype=np.int64)
        states[0] = start
        index = np.empty(rows, dtype=np.int64)
        for t in range(1, width):
            np.multiply(states[t - 1], k, out=index)
            index += slot[t]
            np.take(flat, index, out=states[t])
            np.copyto(states[t], targets[t], where=jumps[t])
        return self.alphabet[states.T]


def resolve_lengths(
    lengths_from: str,
    rows: int | None,
    max_length: int | None,
    seed: int,
    length_scale: float = 1.0,
) -> tuple[np.ndarray, dict[str, int], str, str | None]:
    """Lengths to generate (int64), clip counts, source description and source sha256.

    `length_scale` divides every length (rounded, at least 1) before subsampling and clipping:
    the seed's shape at 1/16 of the size keeps CPU demos fast without a hand-made .npy.
    """
    if not length_scale > 0:
        raise InputError(f"--length-scale {length_scale}: must be positive")
    from trainer.data.lengths import LengthsError, load_lengths, seed_shaped_lengths

    try:
        if lengths_from == "seed-shaped":
            base, source, digest = seed_shaped_lengths(seed=seed), "seed-shaped", None
        else:
            path = Path(lengths_from)
            base = load_lengths(path)
            file = path / "lengths.i32" if path.is_dir() else path
            source, digest = str(path.absolute()), sha256_file(file)
    except LengthsError as exc:
        raise InputError(str(exc)) from None
    if length_scale != 1.0:
        base = np.maximum(1, np.rint(base / length_scale)).astype(np.int64)
    if rows is not None:
        if rows < 1:
            raise InputError(f"--rows {rows}: must be at least 1")
        rng = _rng(seed, _TAG_ROWS)
        base = rng.choice(base, size=rows, replace=rows > base.size)
    if max_length is not None and max_length < MIN_ROW:
        raise InputError(f"--max-length {max_length}: must be at least {MIN_ROW}")
    clipped = {
        "clipped_to_max_length": int(np.count_nonzero(base > max_length)) if max_length else 0,
        "raised_to_min_row": int(np.count_nonzero(base < MIN_ROW)),
    }
    lengths = np.clip(base, MIN_ROW, max_length if max_length else None).astype(np.int64)
    return lengths, clipped, source, digest


def _chunks(lengths: np.ndarray) -> Iterator[slice]:
    """Consecutive row ranges whose padded generation matrix stays around CHUNK_ELEMENTS."""
    start = 0
    while start < lengths.size:
        stop, widest = start, 0
        while stop < lengths.size:
            widest_next = max(widest, int(lengths[stop]))
            if stop > start and (stop - start + 1) * widest_next > CHUNK_ELEMENTS:
                break
            widest, stop = widest_next, stop + 1
        yield slice(start, stop)
        start = stop


def generate(
    lengths: np.ndarray, chain: MarkovChain, seed: int
) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Yield (flat tokens int32, flat mask uint8, lengths) chunk by chunk, rows in order."""
    rng = _rng(seed, _TAG_TOKENS)
    for part in _chunks(lengths):
        lens = lengths[part]
        width = int(lens.max())
        walks = chain.walk(lens.size, width, rng)
        frac = rng.uniform(*PROMPT_FRACTION, size=lens.size)
        prompt = np.clip(np.rint(frac * lens).astype(np.int64), 1, lens - 2)
        cols = np.arange(width)
        valid = cols[None, :] < lens[:, None]
        mask = (cols[None, :] >= prompt[:, None]) & valid
        yield walks[valid].astype(np.int32), mask[valid].astype(np.uint8), lens


def synth_store(
    out: str | os.PathLike[str],
    *,
    lengths_from: str,
    vocab_size: int,
    rows: int | None = None,
    max_length: int | None = None,
    seed: int = 0,
    mask_token_id: int | None = None,
    reserved_top: int = 8,
    length_scale: float = 1.0,
    overwrite: bool = False,
    progress: Callable[[int, int], None] | None = None,
) -> Manifest:
    """Write a learnable synthetic store whose lengths follow `lengths_from`."""
    check_target(out, overwrite)
    if mask_token_id is None:
        mask_token_id = vocab_size - 1
    if not 0 <= mask_token_id < vocab_size:
        raise InputError(
            f"--mask-token-id {mask_token_id}: outside the vocabulary 0..{vocab_size - 1}"
        )
    if reserved_top < 0:
        raise InputError(f"--reserved-top {reserved_top}: must be >= 0")
    reserved = reserved_token_ids(vocab_size, reserved_top, mask_token_id)
    alphabet = np.setdiff1d(np.arange(vocab_size), reserved)
    if alphabet.size < MIN_ALPHABET:
        raise InputError(
            f"--vocab {vocab_size}: leaves {alphabet.size} emittable ids after {len(reserved)} "
            f"reserved; need at least {MIN_ALPHABET}"
        )
    lengths, clipped, source, digest = resolve_lengths(
        lengths_from, rows, max_length, seed, length_scale
    )
    chain = MarkovChain.build(alphabet, seed)
    with StoreWriter(out, overwrite=overwrite) as writer:
        for tokens, mask, lens in generate(lengths, chain, seed):
            writer.add_flat(tokens, mask, lens)
            if progress is not None:
                progress(writer.num_rows, int(lengths.size))
        return writer.commit(
            kind="synthetic",
            source=source,
            source_sha256=digest,
            vocab_size=vocab_size,
            max_length=int(max_length if max_length else lengths.max()),
            reserved_token_ids=reserved,
            mask_token_id=mask_token_id,
            mask_strategy="synthetic: prompt mask 0, response mask 1",
            params={
                "lengths_from": lengths_from,
                "rows": rows,
                "seed": seed,
                "reserved_top": reserved_top,
                "length_scale": length_scale,
                "successor_probs": list(SUCCESSOR_PROBS),
                "jump_prob": JUMP_PROB,
                "prompt_fraction": list(PROMPT_FRACTION),
                "chain_sha256": _chain_digest(chain),
                **clipped,
            },
        )


def _chain_digest(chain: MarkovChain) -> str:
    """Fingerprint of the transition table: two stores with equal digests share a language."""
    digest = hashlib.sha256(chain.alphabet.tobytes())
    digest.update(chain.successors.astype("<i8").tobytes())
    return digest.hexdigest()[:16]
