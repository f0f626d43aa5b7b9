"""Synthetic stores: deterministic, never emit reserved ids, follow the lengths, learnable."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainer.data.errors import InputError
from trainer.data.store import TokenStore
from trainer.data.synth import PROMPT_FRACTION, synth_store

LENGTHS = np.array([3, 7, 40, 120, 300, 64, 5, 250, 90, 33] * 20, dtype=np.int64)


@pytest.fixture
def lengths_npy(tmp_path: Path) -> Path:
    path = tmp_path / "lengths.npy"
    np.save(path, LENGTHS)
    return path


def _synth(out: Path, lengths: Path | str, **kw: object) -> TokenStore:
    params: dict[str, object] = {"vocab_size": 64, "seed": 3}
    params.update(kw)
    synth_store(out, lengths_from=str(lengths), **params)  # type: ignore[arg-type]
    return TokenStore.open(out, verify=True)


def test_same_seed_same_bytes_other_seed_differs(tmp_path: Path, lengths_npy: Path) -> None:
    a = _synth(tmp_path / "a", lengths_npy)
    b = _synth(tmp_path / "b", lengths_npy)
    c = _synth(tmp_path / "c", lengths_npy, seed=4)
    files_a = {k: v.sha256 for k, v in a.manifest.files.items()}
    assert files_a == {k: v.sha256 for k, v in b.manifest.files.items()}
    assert a.manifest.files["tokens.i32"].sha256 != c.manifest.files["tokens.i32"].sha256


def test_reserved_ids_never_emitted_and_listed(tmp_path: Path, lengths_npy: Path) -> None:
    store = _synth(tmp_path / "s", lengths_npy, vocab_size=40, mask_token_id=7, reserved_top=4)
    m = store.manifest
    assert m.reserved_token_ids == [7, 36, 37, 38, 39] and m.mask_token_id == 7
    emitted = np.unique(np.asarray(store.tokens))
    assert not np.isin(emitted, m.reserved_token_ids).any()
    # Everything else is used, so the reservation is the only gap.
    assert emitted.tolist() == sorted(set(range(40)) - set(m.reserved_token_ids))


def test_default_mask_token_is_top_id(tmp_path: Path, lengths_npy: Path) -> None:
    m = _synth(tmp_path / "s", lengths_npy, vocab_size=100).manifest
    assert m.mask_token_id == 99 and m.reserved_token_ids == list(range(92, 100))


def test_lengths_follow_source_and_clip(tmp_path: Path, lengths_npy: Path) -> None:
    store = _synth(tmp_path / "s", lengths_npy, max_length=100)
    expected = np.clip(LENGTHS, 3, 100)
    assert store.lengths.tolist() == expected.tolist()
    assert store.manifest.max_length == 100
    assert store.manifest.params["clipped_to_max_length"] == int((LENGTHS > 100).sum())
    sub = _synth(tmp_path / "sub", lengths_npy, rows=25)
    assert len(sub) == 25 and set(sub.lengths.tolist()) <= set(LENGTHS.tolist())


def test_length_scale_shrinks_the_shape(tmp_path: Path, lengths_npy: Path) -> None:
    store = _synth(tmp_path / "s", lengths_npy, length_scale=10)
    assert store.lengths.tolist() == np.clip(np.rint(LENGTHS / 10), 3, None).astype(int).tolist()
    assert store.manifest.params["length_scale"] == 10
    with pytest.raises(InputError, match="--length-scale 0: must be positive"):
        _synth(tmp_path / "t", lengths_npy, length_scale=0)


def test_rows_are_prompt_then_response(tmp_path: Path, lengths_npy: Path) -> None:
    store = _synth(tmp_path / "s", lengths_npy)
    for i in range(len(store)):
        _, mask = store.row(i)
        n = mask.size
        prompt = int(np.argmax(mask))  # first supervised position
        assert mask[0] == 0 and mask[prompt:].all() and not mask[:prompt].any()
        assert n - prompt >= 2  # room for at least one anchor pair
        if n >= 40:  # small rows are clamped to keep one prompt token and two response tokens
            assert PROMPT_FRACTION[0] - 0.05 <= prompt / n <= PROMPT_FRACTION[1] + 0.05


def test_tokens_are_learnable(tmp_path: Path) -> None:
    lengths = tmp_path / "l.npy"
    np.save(lengths, np.full(400, 256, dtype=np.int64))
    store = _synth(tmp_path / "s", lengths, vocab_size=128)
    vocab = store.manifest.vocab_size
    counts = np.ones((vocab, vocab))  # add-one bigram model on the first half
    for i in range(200):
        tok, _ = store.row(i)
        np.add.at(counts, (tok[:-1], tok[1:]), 1)
    probs = counts / counts.sum(axis=1, keepdims=True)
    nll = []
    for i in range(200, 400):
        tok, mask = store.row(i)
        supervised = mask[1:].astype(bool)
        nll.append(-np.log(probs[tok[:-1], tok[1:]])[supervised])
    held_out = float(np.concatenate(nll).mean())
    uniform = np.log(vocab - len(store.manifest.reserved_token_ids))
    # The chain's entropy is ~1.3 nats; a memoryless stream would sit at log(120) = 4.8.
    assert held_out < 0.4 * uniform


def test_seed_shaped_subsample(tmp_path: Path) -> None:
    store = _synth(tmp_path / "s", "seed-shaped", rows=50, max_length=512)
    assert len(store) == 50
    assert int(store.lengths.min()) >= 65
    assert int(store.lengths.max()) <= 512
    assert store.manifest.source == "seed-shaped"


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"vocab_size": 12}, r"--vocab 12: leaves 4 emittable ids"),
        ({"mask_token_id": 64}, r"--mask-token-id 64: outside the vocabulary 0\.\.63"),
        ({"rows": 0}, r"--rows 0: must be at least 1"),
        ({"max_length": 2}, r"--max-length 2: must be at least 3"),
    ],
)
def test_bad_options_name_the_option(
    tmp_path: Path, lengths_npy: Path, kw: dict[str, object], message: str
) -> None:
    with pytest.raises(InputError, match=message):
        _synth(tmp_path / "s", lengths_npy, **kw)
    assert not (tmp_path / "s").exists()


def test_bad_lengths_file_names_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.npy"
    np.save(bad, np.array([5, 0, 7]))
    with pytest.raises(InputError, match=r"bad\.npy: length 0 at index 1"):
        _synth(tmp_path / "s", bad)
    with pytest.raises(InputError, match=r"absent\.npy: no such file"):
        _synth(tmp_path / "s", tmp_path / "absent.npy")
