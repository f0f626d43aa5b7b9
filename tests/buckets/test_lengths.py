"""Seed-shaped lengths and loading: the synthetic distribution hits the seed's published figures."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from trainer.data.lengths import (
    SEED_KNOTS,
    SEED_N,
    SEED_TOTAL_TOKENS,
    LengthsError,
    fit_lambda,
    load_lengths,
    seed_shaped_lengths,
)

SAMPLE = Path(__file__).resolve().parents[2] / "trainer" / "data" / "samples" / "seed_lengths.npy"


@pytest.fixture(scope="module")
def bundled() -> np.ndarray:
    return load_lengths(SAMPLE)


def test_bundled_sample_hits_every_published_knot_and_the_exact_total(bundled: np.ndarray) -> None:
    """P0..P100 equal the seed's percentiles; 902,087 samples; exactly 1.866e9 tokens (int64)."""
    assert bundled.dtype == np.int64 and bundled.size == SEED_N
    assert int(bundled.sum()) == SEED_TOTAL_TOKENS
    for p, q in SEED_KNOTS:
        assert np.percentile(bundled, p * 100) == q, p
    assert abs(np.percentile(bundled, 99.9) - 7834) < 1


def test_bundled_sample_is_the_generator_output_stored_as_int16(bundled: np.ndarray) -> None:
    """The shipped file is int16 and is the multiset seed_shaped_lengths() produces."""
    assert np.load(SAMPLE).dtype == np.int16
    assert np.array_equal(np.sort(bundled), np.sort(seed_shaped_lengths()))


def test_lambda_is_bisected_to_the_reference_values() -> None:
    """Box-Cox lambda matches bucketing.md: 0.5931 (primary) and 0.938 (thin tail)."""
    assert fit_lambda()[0] == pytest.approx(0.5931, abs=1e-4)
    assert fit_lambda(variant="thin")[0] == pytest.approx(0.938, abs=1e-3)


def test_thin_variant_keeps_knots_and_squeezes_the_tail() -> None:
    """The thin variant keeps every knot and the total, with P99.9 near 5842."""
    x = seed_shaped_lengths(variant="thin")
    assert int(x.sum()) == SEED_TOTAL_TOKENS
    for p, q in SEED_KNOTS:
        assert np.percentile(x, p * 100) == q
    assert abs(np.percentile(x, 99.9) - 5842) < 1


def test_seed_permutes_but_keeps_the_multiset() -> None:
    """Different seeds shuffle the same lengths; a prefix is a representative subsample."""
    a, b = seed_shaped_lengths(20_000, seed=1), seed_shaped_lengths(20_000, seed=2)
    assert not np.array_equal(a, b) and np.array_equal(np.sort(a), np.sort(b))


def test_load_lengths_reads_a_token_store_directory(tmp_path: Path) -> None:
    """A store dir is read through its lengths.i32 file (little-endian int32)."""
    np.array([5, 70, 9000], dtype="<i4").tofile(tmp_path / "lengths.i32")
    assert load_lengths(tmp_path).tolist() == [5, 70, 9000]


@pytest.mark.parametrize(
    ("payload", "needle"),
    [
        (np.array([1.0, 2.5]), r"non-integer length 2\.5 at index 1"),
        (np.array([3, 0, 4]), "length 0 at index 1"),
        (np.zeros((2, 2), dtype=np.int64), "1-D"),
        (np.array([], dtype=np.int64), "empty"),
        (np.array(["a"]), "dtype"),
    ],
)
def test_bad_lengths_files_give_one_line_errors_naming_the_file(
    tmp_path: Path, payload: np.ndarray, needle: str
) -> None:
    """Malformed arrays are refused with the file name and the offending value."""
    f = tmp_path / "bad.npy"
    np.save(f, payload)
    with pytest.raises(LengthsError, match=needle) as err:
        load_lengths(f)
    assert str(f) in str(err.value) and "\n" not in str(err.value)


def test_missing_and_garbage_files_are_named(tmp_path: Path) -> None:
    """Missing files, non-npy files and dirs without lengths.i32 are clear errors."""
    with pytest.raises(LengthsError, match="no such file"):
        load_lengths(tmp_path / "nope.npy")
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not numpy")
    with pytest.raises(LengthsError, match=r"junk\.npy"):
        load_lengths(junk)
    with pytest.raises(LengthsError, match="not a token store"):
        load_lengths(tmp_path)
