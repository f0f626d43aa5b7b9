"""TokenStore format, validation and the writer's all-or-nothing publish."""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

from trainer.data.store import (
    LENGTHS,
    MANIFEST,
    MASK,
    OFFSETS,
    TOKENS,
    StoreError,
    StoreWriter,
    TokenStore,
    sha256_file,
)

ROWS = [
    ([5, 6, 7, 8], [0, 0, 1, 1]),
    ([1, 2, 3], [0, 1, 1]),
    ([9, 9, 9, 9, 9, 9], [0, 1, 1, 1, 1, 0]),
]


def _fields(**over: object) -> dict[str, object]:
    base: dict[str, object] = {
        "kind": "synthetic",
        "source": "unit test",
        "vocab_size": 16,
        "max_length": 8,
        "mask_strategy": "given",
    }
    base.update(over)
    return base


def write_store(
    path: Path, rows: Iterable[tuple[list[int], list[int]]] = ROWS, **over: object
) -> Path:
    with StoreWriter(path) as writer:
        for tokens, mask in rows:
            writer.add(tokens, mask)
        writer.commit(**_fields(**over))
    return path


def test_round_trip(tmp_path: Path) -> None:
    store = TokenStore.open(write_store(tmp_path / "s"), verify=True)
    assert len(store) == 3
    assert store.lengths.dtype == np.int32
    assert store.lengths.tolist() == [4, 3, 6]
    for i, (tokens, mask) in enumerate(ROWS):
        tok, msk = store.row(i)
        assert tok.dtype == np.int32 and msk.dtype == np.uint8
        assert tok.tolist() == tokens and msk.tolist() == mask
    assert store.row(-1)[0].tolist() == ROWS[-1][0]
    m = store.manifest
    assert (m.num_rows, m.num_tokens, m.num_supervised_tokens) == (3, 13, 8)
    assert store.offsets.tolist() == [0, 4, 7, 13]
    with pytest.raises(IndexError):
        store.row(3)


def test_raw_files_are_little_endian_flat_arrays(tmp_path: Path) -> None:
    root = write_store(tmp_path / "s")
    assert np.fromfile(root / TOKENS, "<i4").tolist() == [t for r in ROWS for t in r[0]]
    assert np.fromfile(root / MASK, "u1").tolist() == [t for r in ROWS for t in r[1]]
    assert np.fromfile(root / OFFSETS, "<i8").tolist() == [0, 4, 7, 13]
    assert np.fromfile(root / LENGTHS, "<i4").tolist() == [4, 3, 6]


def test_manifest_hashes_match_files(tmp_path: Path) -> None:
    root = write_store(tmp_path / "s")
    manifest = json.loads((root / MANIFEST).read_text())
    for name in (TOKENS, MASK, OFFSETS, LENGTHS):
        assert manifest["files"][name]["sha256"] == sha256_file(root / name)
        assert manifest["files"][name]["bytes"] == (root / name).stat().st_size


def test_gather_pads_with_mask_zero(tmp_path: Path) -> None:
    store = TokenStore.open(write_store(tmp_path / "s"))
    tokens, mask, lens = store.gather([1, 0], pad_to=5, pad_id=15)
    assert tokens.tolist() == [[1, 2, 3, 15, 15], [5, 6, 7, 8, 15]]
    assert mask.tolist() == [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0]]
    assert lens.tolist() == [3, 4]
    with pytest.raises(ValueError, match="pad_to"):
        store.gather([2], pad_to=3)


def test_pickle_reopens_by_path(tmp_path: Path) -> None:
    store = TokenStore.open(write_store(tmp_path / "s"))
    clone = pickle.loads(pickle.dumps(store))
    assert clone.path == store.path and clone.row(2)[0].tolist() == ROWS[2][0]


def test_empty_store_opens(tmp_path: Path) -> None:
    store = TokenStore.open(write_store(tmp_path / "s", rows=[]), verify=True)
    assert len(store) == 0 and store.lengths.size == 0


def test_exception_mid_write_leaves_nothing(tmp_path: Path) -> None:
    target = tmp_path / "s"

    def rows() -> Iterator[tuple[list[int], list[int]]]:
        yield from ROWS[:2]
        raise RuntimeError("tokenizer exploded")

    with pytest.raises(RuntimeError, match="exploded"), StoreWriter(target) as writer:
        for tokens, mask in rows():
            writer.add(tokens, mask)
        writer.commit(**_fields())
    assert not target.exists()
    assert list(tmp_path.iterdir()) == []


def test_keyboard_interrupt_keeps_existing_store(tmp_path: Path) -> None:
    target = write_store(tmp_path / "s")
    before = sha256_file(target / TOKENS)
    with pytest.raises(KeyboardInterrupt), StoreWriter(target, overwrite=True) as writer:
        writer.add([1, 1], [1, 1])
        raise KeyboardInterrupt
    assert sha256_file(target / TOKENS) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    TokenStore.open(target, verify=True)


def test_overwrite_replaces_whole_store(tmp_path: Path) -> None:
    target = write_store(tmp_path / "s")
    with pytest.raises(StoreError, match="already exists"):
        StoreWriter(target)
    with StoreWriter(target, overwrite=True) as writer:
        writer.add([3, 3], [1, 1])
        writer.commit(**_fields())
    store = TokenStore.open(target, verify=True)
    assert len(store) == 1 and store.row(0)[0].tolist() == [3, 3]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_uncommitted_writer_leaves_nothing(tmp_path: Path) -> None:
    with StoreWriter(tmp_path / "s") as writer:
        writer.add([1], [1])
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_of_dead_writer_is_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".s.tmp-999999999-abcd"
    stale.mkdir()
    (stale / TOKENS).write_bytes(b"\0" * 8)
    write_store(tmp_path / "s")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_row_longer_than_max_length_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="max_length"):
        write_store(tmp_path / "s", max_length=5)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda r: (r / MANIFEST).unlink(), r"manifest\.json: missing"),
        (lambda r: (r / MANIFEST).write_text("{nope"), r"manifest\.json: unreadable manifest"),
        (lambda r: (r / TOKENS).unlink(), r"tokens\.i32: missing data file"),
        (
            lambda r: (r / TOKENS).write_bytes((r / TOKENS).read_bytes()[:-4]),
            r"tokens\.i32: 48 bytes, manifest says 52",
        ),
        (
            lambda r: (r / LENGTHS).write_bytes(np.array([4, 4, 5], "<i4").tobytes()),
            r"lengths\.i32: row 1 length 4 disagrees with offsets \(3\)",
        ),
        (
            lambda r: _edit_manifest(r, format_version=7),
            r"manifest\.json: format_version 7 is not supported",
        ),
        (
            lambda r: _edit_manifest(r, num_rows="three"),
            r"manifest\.json: invalid manifest: num_rows: ",
        ),
        (
            lambda r: _edit_manifest(r, surprise=1),
            r"manifest\.json: invalid manifest: surprise: unknown key",
        ),
    ],
)
def test_open_rejects_damage_naming_the_file(
    tmp_path: Path, damage: Callable[[Path], object], message: str
) -> None:
    root = write_store(tmp_path / "s")
    damage(root)
    with pytest.raises(StoreError, match=message) as info:
        TokenStore.open(root)
    assert "\n" not in str(info.value)


def _edit_manifest(root: Path, **changes: object) -> None:
    data = json.loads((root / MANIFEST).read_text())
    data.update(changes)
    (root / MANIFEST).write_text(json.dumps(data))


def test_verify_catches_same_size_corruption(tmp_path: Path) -> None:
    root = write_store(tmp_path / "s")
    data = bytearray((root / TOKENS).read_bytes())
    data[0] ^= 0x01
    (root / TOKENS).write_bytes(bytes(data))
    TokenStore.open(root)  # sizes still agree: the cheap open cannot tell
    with pytest.raises(StoreError, match=r"tokens\.i32: sha256 .* does not match"):
        TokenStore.open(root, verify=True)


def test_verify_rejects_reserved_ids(tmp_path: Path) -> None:
    root = write_store(tmp_path / "s", reserved_token_ids=[9])
    with pytest.raises(StoreError, match="reserved token id"):
        TokenStore.open(root, verify=True)


def test_missing_directory(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no such token store directory"):
        TokenStore.open(tmp_path / "absent")


def test_store_published_meanwhile_is_kept(tmp_path: Path) -> None:
    target = tmp_path / "s"
    # StoreExistsError is a FileExistsError, which is what concurrent ranks catch.
    with (
        pytest.raises(FileExistsError, match="appeared while writing"),
        StoreWriter(target) as writer,
    ):
        writer.add([1, 1], [1, 1])
        write_store(target)  # another rank wins the race
        writer.commit(**_fields())
    assert TokenStore.open(target, verify=True).lengths.tolist() == [4, 3, 6]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_errors_naming_a_sample_trace_it_to_its_input_line(tmp_path: Path) -> None:
    """`sample 1` in a planner/sampler error becomes `sample 1 (input line 7)` for a store that
    kept its source lines; a store without them leaves the message as it is."""
    traced = tmp_path / "traced"
    with StoreWriter(traced) as writer:
        for line, tokens in ((3, [5, 6]), (7, [5, 6, 7, 8]), (9, [5])):
            writer.add(tokens, [1] * len(tokens), source_line=line)
        writer.commit(**_fields())
    store = TokenStore.open(traced)
    msg = "sample 1 has 4 tokens, more than token_budget 3; resample 12 and sample 9"
    assert store.name_rows(msg) == (
        "sample 1 (input line 7) has 4 tokens, more than token_budget 3; resample 12 and sample 9"
    )
    plain = TokenStore.open(write_store(tmp_path / "plain"))
    assert plain.name_rows(msg) == msg
