"""Memory-mapped token store: the one on-disk format every trainer stage reads.

Layout of a store directory (all raw little-endian, no headers, so any tool can mmap them):

    tokens.i32    flat int32 token ids of every row, back to back
    mask.u8       flat uint8 loss mask aligned with tokens (1 = supervised)
    offsets.i64   n+1 int64 row starts into tokens (offsets[0] = 0, offsets[n] = total tokens)
    lengths.i32   n int32 row lengths (= diff(offsets), kept so the planner reads 4n bytes)
    lines.i64     optional: n int64 1-based source lines (chat imports), so row i can be traced
                  to its JSONL line; stores written before it existed simply lack the file
    manifest.json provenance and counts (`Manifest`), written last

Writers build the store in a hidden temp directory next to the target and rename it into place
only after every file and the manifest are flushed, so a crash or Ctrl-C never leaves a store
that opens but lies. Torch-free: numpy + pydantic only.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
from array import array
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Final, Literal, Self

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from trainer.config.validation import dotted, one_line
from trainer.errors import TrainerError

FORMAT_VERSION: Final = 1
MANIFEST = "manifest.json"
TOKENS = "tokens.i32"
MASK = "mask.u8"
OFFSETS = "offsets.i64"
LENGTHS = "lengths.i32"
LINES = "lines.i64"
_SAMPLE_RE = re.compile(r"\bsample (\d+)\b")
DATA_FILES: dict[str, np.dtype[Any]] = {
    TOKENS: np.dtype("<i4"),
    MASK: np.dtype("u1"),
    OFFSETS: np.dtype("<i8"),
    LENGTHS: np.dtype("<i4"),
    LINES: np.dtype("<i8"),
}
FIRST_LINES_KEPT = 10  # line numbers remembered per skip reason: enough to find the pattern
# Details (with their line) remembered per skip reason: the first few of every kind, where a
# kind is the detail with its numbers blanked ("message 3 content part 0 has type 'image_url'"
# and "message 1 ..." are one kind), so a rare cause is shown beside a frequent one.
EXAMPLES_PER_KIND = 2
KINDS_KEPT = 12
_NUMBER = re.compile(r"\d+")
_TMP_MARK = ".tmp-"
_HASH_CHUNK = 1 << 22


class StoreError(TrainerError):
    """A store is missing, malformed or inconsistent; the message is one line naming the file."""


class StoreExistsError(StoreError, FileExistsError):
    """The target store already exists (or another writer published it first)."""


class FileEntry(BaseModel):
    """Size and content hash of one data file, so a truncated copy or bit rot is detectable."""

    model_config = ConfigDict(extra="forbid")
    bytes: int = Field(ge=0)
    sha256: str = Field(pattern=r"^[0-9a-f]{64}$")


class LineStat(BaseModel):
    """How many input rows hit one condition, and the first few 1-based line numbers."""

    model_config = ConfigDict(extra="forbid")
    count: int = 0
    first_lines: list[int] = Field(default_factory=list)
    examples: list[str] = Field(default_factory=list)  # "line N: detail", distinct details

    def add(self, line: int, detail: str | None = None) -> None:
        self.count += 1
        if len(self.first_lines) < FIRST_LINES_KEPT:
            self.first_lines.append(line)
        if not detail:
            return
        details = [e.split(": ", 1)[-1] for e in self.examples]
        kinds = [detail_kind(d) for d in details]
        kind = detail_kind(detail)
        same = kinds.count(kind)
        new_kind = same == 0 and len(set(kinds)) < KINDS_KEPT
        if detail not in details and (new_kind or 0 < same < EXAMPLES_PER_KIND):
            self.examples.append(f"line {line}: {detail}")


def detail_kind(detail: str) -> str:
    """A skip detail with its numbers blanked: what makes two details the same cause."""
    return _NUMBER.sub("#", detail)


class TokenizerIdentity(BaseModel):
    """Which tokenizer produced the ids: a store is only valid for a target with the same one."""

    model_config = ConfigDict(extra="forbid")
    name_or_path: str
    class_name: str
    sha256: str  # over the sorted (file name, file sha256) pairs below
    files: dict[str, str]  # tokenizer file name -> sha256


class Manifest(BaseModel):
    """Everything needed to trust, reproduce and size a store without reading its data."""

    model_config = ConfigDict(extra="forbid")
    format_version: Literal[1] = FORMAT_VERSION
    kind: Literal["chat-import", "synthetic"]
    created_at: datetime
    source: str  # input file (absolute path) or a description such as "seed-shaped"
    source_sha256: str | None = None
    tokenizer: TokenizerIdentity | None = None
    vocab_size: int = Field(gt=0)
    max_length: int = Field(gt=0)
    num_rows: int = Field(ge=0)
    num_tokens: int = Field(ge=0)
    num_supervised_tokens: int = Field(ge=0)
    skipped: dict[str, LineStat] = Field(default_factory=dict)
    truncated: LineStat = Field(default_factory=LineStat)
    reserved_token_ids: list[int] = Field(default_factory=list)  # ids guaranteed absent
    mask_token_id: int | None = None
    mask_strategy: str  # how the loss mask was derived (see docs/design.md, Data layer)
    params: dict[str, Any] = Field(default_factory=dict)  # the command's knobs, for rebuilding
    files: dict[str, FileEntry]

    @property
    def num_skipped(self) -> int:
        return sum(stat.count for stat in self.skipped.values())


def sha256_file(path: Path) -> str:
    """Hash a file in chunks (stores reach many GB; never read one whole)."""
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        while chunk := fh.read(_HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())


def _read_manifest(root: Path) -> Manifest:
    path = root / MANIFEST
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise StoreError(f"{path}: missing; {root} is not a token store") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoreError(f"{path}: unreadable manifest: {_one_line(exc)}") from None
    if not isinstance(raw, dict):
        raise StoreError(f"{path}: manifest is not a JSON object")
    version = raw.get("format_version")
    if version != FORMAT_VERSION:
        raise StoreError(
            f"{path}: format_version {version!r} is not supported (this reader knows {FORMAT_VERSION})"
        )
    try:
        return Manifest.model_validate(raw)
    except ValidationError as exc:
        detail = one_line(exc, key=lambda loc: dotted(loc, "<root>"))
        raise StoreError(f"{path}: invalid manifest: {detail}") from None


def _map(path: Path, dtype: np.dtype[Any], count: int) -> np.ndarray:
    """Read-only mapping as a plain ndarray view (the memmap subclass makes every index slow)."""
    if count == 0:  # np.memmap refuses empty files
        return np.empty(0, dtype=dtype)
    try:
        return np.memmap(path, dtype=dtype, mode="r", shape=(count,)).view(np.ndarray)
    except OSError as exc:
        raise StoreError(f"{path}: cannot map: {_one_line(exc)}") from None


class TokenStore:
    """Read-only, memory-mapped view of a store; cheap to open, safe to share across processes."""

    def __init__(
        self,
        path: Path,
        manifest: Manifest,
        tokens: np.ndarray,
        mask: np.ndarray,
        offsets: np.ndarray,
        lengths: np.ndarray,
        lines: np.ndarray | None = None,
    ) -> None:
        self.path = path
        self.manifest = manifest
        self.tokens = tokens
        self.mask = mask
        self.offsets = offsets
        self.lengths = lengths
        self.lines = lines  # 1-based source line per row, None for stores without them

    @classmethod
    def open(cls, path: str | os.PathLike[str], verify: bool = False) -> TokenStore:
        """Open and validate a store: manifest, file sizes, offsets; with `verify`, hashes and ids.

        The cheap checks (sizes, offsets/lengths agreement) always run because a mismatch there
        would silently feed the trainer garbage; hashing reads every byte, so it is opt-in.
        """
        root = Path(path)
        if not root.is_dir():
            raise StoreError(f"{root}: no such token store directory")
        manifest = _read_manifest(root)
        n, t = manifest.num_rows, manifest.num_tokens
        expected = {TOKENS: t, MASK: t, OFFSETS: n + 1, LENGTHS: n}
        if LINES in manifest.files:  # optional (older stores have no source lines)
            expected[LINES] = n
        for name, count in expected.items():
            file = root / name
            want = count * DATA_FILES[name].itemsize
            entry = manifest.files.get(name)
            if entry is None:
                raise StoreError(f"{root / MANIFEST}: no entry for data file {name}")
            if entry.bytes != want:
                raise StoreError(
                    f"{root / MANIFEST}: files.{name}.bytes={entry.bytes} but the row/token "
                    f"counts need {want}"
                )
            try:
                size = file.stat().st_size
            except FileNotFoundError:
                raise StoreError(f"{file}: missing data file") from None
            if size != want:
                raise StoreError(f"{file}: {size} bytes, manifest says {want} (truncated copy?)")
            if verify:
                digest = sha256_file(file)
                if digest != entry.sha256:
                    raise StoreError(
                        f"{file}: sha256 {digest[:12]}… does not match manifest {entry.sha256[:12]}…"
                    )
        tokens = _map(root / TOKENS, DATA_FILES[TOKENS], t)
        mask = _map(root / MASK, DATA_FILES[MASK], t)
        offsets = _map(root / OFFSETS, DATA_FILES[OFFSETS], n + 1)
        lengths = _map(root / LENGTHS, DATA_FILES[LENGTHS], n)
        lines = _map(root / LINES, DATA_FILES[LINES], n) if LINES in expected else None
        _check_offsets(root, manifest, offsets, lengths)
        if verify:
            _check_contents(root, manifest, tokens, mask)
        return cls(root, manifest, tokens, mask, offsets, lengths, lines)

    def __len__(self) -> int:
        return self.manifest.num_rows

    @property
    def num_tokens(self) -> int:
        return self.manifest.num_tokens

    def row(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (int32) and loss mask (uint8) of row `i`: zero-copy read-only views."""
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {self.path} with {n} rows")
        i %= n
        lo, hi = self.offsets[i : i + 2].tolist()
        return self.tokens[lo:hi], self.mask[lo:hi]

    __getitem__ = row

    def source_line(self, i: int) -> int | None:
        """The input line row `i` came from (chat imports), None when the store has none."""
        if self.lines is None:
            return None
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"row {i} out of range for {self.path} with {n} rows")
        return int(self.lines[i % n])

    def name_rows(self, message: str) -> str:
        """`message` with each "sample N" that names a row of this store followed by the input
        line it came from (`sample 122 (input line 517)`), so a planner or sampler error can be
        traced to the JSONL; unchanged for stores without source lines."""
        lines = self.lines
        if lines is None:
            return message

        def traced(m: re.Match[str]) -> str:
            i = int(m.group(1))
            return f"{m.group(0)} (input line {int(lines[i])})" if i < len(lines) else m.group(0)

        return _SAMPLE_RE.sub(traced, message)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        for i in range(len(self)):
            yield self.row(i)

    def gather(
        self, indices: Sequence[int] | np.ndarray, *, pad_to: int | None = None, pad_id: int = 0
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Right-padded batch: tokens [B, L] int32, mask [B, L] uint8 (0 on padding), lengths [B].

        L is the longest selected row unless `pad_to` (e.g. a bucket's edge) is larger; padding
        carries mask 0 so it can never become an anchor or a label.
        """
        idx = np.asarray(indices, dtype=np.int64)
        lens = self.lengths[idx].astype(np.int64) if idx.size else np.zeros(0, np.int64)
        width = int(lens.max(initial=0))
        if pad_to is not None:
            if pad_to < width:
                raise ValueError(f"pad_to={pad_to} is shorter than the longest row ({width})")
            width = pad_to
        tokens = np.full((idx.size, width), pad_id, dtype=np.int32)
        mask = np.zeros((idx.size, width), dtype=np.uint8)
        for b, (lo, n) in enumerate(zip(self.offsets[idx].tolist(), lens.tolist(), strict=True)):
            tokens[b, :n] = self.tokens[lo : lo + n]
            mask[b, :n] = self.mask[lo : lo + n]
        return tokens, mask, lens

    def __reduce__(self) -> tuple[Any, ...]:
        # Re-open by path in the receiving process instead of pickling the mapped bytes.
        return (TokenStore.open, (str(self.path),))

    def __repr__(self) -> str:
        m = self.manifest
        return f"TokenStore({str(self.path)!r}, rows={m.num_rows}, tokens={m.num_tokens})"


def _check_offsets(root: Path, m: Manifest, offsets: np.ndarray, lengths: np.ndarray) -> None:
    if int(offsets[0]) != 0 or int(offsets[-1]) != m.num_tokens:
        raise StoreError(
            f"{root / OFFSETS}: must run from 0 to num_tokens={m.num_tokens}, "
            f"got {int(offsets[0])}..{int(offsets[-1])}"
        )
    if m.num_rows == 0:
        return
    diffs = np.diff(offsets)
    if not np.array_equal(diffs, lengths):
        bad = int(np.flatnonzero(diffs != lengths)[0])
        raise StoreError(
            f"{root / LENGTHS}: row {bad} length {int(lengths[bad])} disagrees with offsets ({int(diffs[bad])})"
        )
    if int(lengths.min()) < 1 or int(lengths.max()) > m.max_length:
        raise StoreError(
            f"{root / LENGTHS}: lengths span {int(lengths.min())}..{int(lengths.max())}, "
            f"outside 1..max_length={m.max_length}"
        )


def _check_contents(root: Path, m: Manifest, tokens: np.ndarray, mask: np.ndarray) -> None:
    if m.num_tokens == 0:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= m.vocab_size:
        raise StoreError(
            f"{root / TOKENS}: token ids span {lo}..{hi}, outside 0..{m.vocab_size - 1}"
        )
    if m.reserved_token_ids and np.isin(tokens, m.reserved_token_ids).any():
        raise StoreError(f"{root / TOKENS}: contains a reserved token id {m.reserved_token_ids}")
    if int(mask.max()) > 1:
        raise StoreError(f"{root / MASK}: values other than 0/1")
    supervised = int(np.count_nonzero(mask))
    if supervised != m.num_supervised_tokens:
        raise StoreError(
            f"{root / MASK}: {supervised} supervised tokens, manifest says {m.num_supervised_tokens}"
        )


class _HashingWriter:
    """Append-only file that hashes what it writes, so the manifest needs no second read."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fh = path.open("wb")
        self._digest = hashlib.sha256()
        self.bytes = 0

    def write(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array).data.cast("B")
        self._fh.write(data)
        self._digest.update(data)
        self.bytes += data.nbytes

    def finish(self) -> FileEntry:
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        return FileEntry(bytes=self.bytes, sha256=self._digest.hexdigest())

    def close(self) -> None:
        self._fh.close()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale_temps(target: Path) -> None:
    """Remove temp dirs that killed (SIGKILL, power loss) writers of this target left behind."""
    prefix = f".{target.name}{_TMP_MARK}"
    for entry in target.parent.glob(f"{prefix}*"):
        pid_part = entry.name[len(prefix) :].split("-", 1)[0]
        if entry.is_dir() and pid_part.isdigit() and not _pid_alive(int(pid_part)):
            shutil.rmtree(entry, ignore_errors=True)


def check_target(target: str | os.PathLike[str], overwrite: bool = False) -> Path:
    """Fail fast (before hours of work) when `target` cannot be written; returns it absolute."""
    path = Path(target).absolute()
    if path.exists() and not overwrite:
        raise StoreExistsError(f"{path}: already exists (pass overwrite/--force to replace it)")
    if not path.parent.is_dir():
        raise StoreError(f"{path.parent}: parent directory does not exist")
    return path


class StoreWriter:
    """Build a store row by row in a temp dir and publish it with a rename.

    Use as a context manager: on any exception (including KeyboardInterrupt) the temp dir is
    removed and the target is untouched; `commit(...)` writes the manifest and renames. An
    existing target is only replaced with `overwrite=True`, and then via rename-aside, so at no
    moment is a half-written store visible under the target name.
    """

    def __init__(self, target: str | os.PathLike[str], *, overwrite: bool = False) -> None:
        self.target = check_target(target, overwrite)
        self.overwrite = overwrite
        _remove_stale_temps(self.target)
        tmp_name = f".{self.target.name}{_TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"
        self.tmp = self.target.parent / tmp_name
        self.tmp.mkdir()
        self._tokens = _HashingWriter(self.tmp / TOKENS)
        self._mask = _HashingWriter(self.tmp / MASK)
        self._lengths = array("i")  # 4 bytes a row, not a Python int: stores reach 1e8 rows
        self._lines = array("q")  # source lines, when every row has one
        self.num_tokens = 0
        self.num_supervised_tokens = 0
        self._done = False

    @property
    def num_rows(self) -> int:
        return len(self._lengths)

    def add(
        self,
        tokens: np.ndarray | Sequence[int],
        mask: np.ndarray | Sequence[int],
        source_line: int | None = None,
    ) -> None:
        """Append one row; tokens and mask must have the same, non-zero length.

        `source_line` (1-based) is given for every row or for none; with it the store keeps
        `lines.i64` so a row number in any later error can be traced to the input.
        """
        tok = np.asarray(tokens, dtype=np.int32)
        msk = np.asarray(mask, dtype=np.uint8)
        if tok.ndim != 1 or tok.shape != msk.shape or tok.size == 0:
            raise ValueError(f"row {self.num_rows}: tokens {tok.shape} / mask {msk.shape} mismatch")
        if self.num_rows and (source_line is None) != (len(self._lines) == 0):
            raise ValueError(
                f"row {self.num_rows}: source lines must be given for all rows or none"
            )
        if source_line is not None:
            self._lines.append(source_line)
        self._tokens.write(tok)
        self._mask.write(msk)
        self._lengths.append(int(tok.size))
        self.num_tokens += int(tok.size)
        self.num_supervised_tokens += int(np.count_nonzero(msk))

    def add_flat(self, tokens: np.ndarray, mask: np.ndarray, lengths: np.ndarray) -> None:
        """Append many rows given back to back (fast path for generators)."""
        lens = np.asarray(lengths, dtype=np.int64)
        if tokens.shape != mask.shape or int(lens.sum()) != tokens.size or (lens < 1).any():
            raise ValueError("add_flat: tokens, mask and lengths disagree")
        self._tokens.write(np.asarray(tokens, dtype=np.int32))
        self._mask.write(np.asarray(mask, dtype=np.uint8))
        self._lengths.frombytes(lens.astype(np.int32).tobytes())
        self.num_tokens += int(tokens.size)
        self.num_supervised_tokens += int(np.count_nonzero(mask))

    def commit(self, **manifest_fields: Any) -> Manifest:
        """Finish the files, write the manifest, and atomically publish the store.

        `manifest_fields` are the provenance fields (kind, source, vocab_size, max_length, ...);
        counts, file hashes and created_at are filled in here so they cannot disagree.
        """
        lengths = (
            np.frombuffer(self._lengths, dtype=np.int32) if self._lengths else np.zeros(0, np.int32)
        )
        offsets = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        files = {TOKENS: self._tokens.finish(), MASK: self._mask.finish()}
        columns: list[tuple[str, np.ndarray]] = [(OFFSETS, offsets), (LENGTHS, lengths)]
        if self._lines and len(self._lines) == self.num_rows:
            columns.append((LINES, np.frombuffer(self._lines, dtype=np.int64)))
        elif self._lines:
            raise ValueError("source lines were given for some rows only")
        for name, values in columns:
            writer = _HashingWriter(self.tmp / name)
            writer.write(values.astype(DATA_FILES[name], copy=False))
            files[name] = writer.finish()
        manifest = Manifest(
            created_at=datetime.now(UTC),
            num_rows=self.num_rows,
            num_tokens=self.num_tokens,
            num_supervised_tokens=self.num_supervised_tokens,
            files=files,
            **manifest_fields,
        )
        if self.num_rows and int(lengths.max()) > manifest.max_length:
            raise ValueError(f"a row of {int(lengths.max())} tokens exceeds max_length")
        manifest_path = self.tmp / MANIFEST
        with manifest_path.open("w", encoding="utf-8") as fh:
            fh.write(manifest.model_dump_json(indent=2))
            fh.write("\n")
            fh.flush()
            os.fsync(fh.fileno())
        self._publish()
        self._done = True
        return manifest

    def _publish(self) -> None:
        aside: Path | None = None
        if self.target.exists():
            if not self.overwrite:
                raise StoreExistsError(f"{self.target}: appeared while writing; not replacing it")
            aside = self.target.parent / f".{self.target.name}.old-{secrets.token_hex(4)}"
            self.target.rename(aside)
        try:
            self.tmp.rename(self.target)
        except OSError as exc:
            if aside is not None:
                try:
                    aside.rename(self.target)
                except OSError:  # a concurrent writer's complete store took the name
                    shutil.rmtree(aside, ignore_errors=True)
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):  # a concurrent writer won the race
                raise StoreExistsError(
                    f"{self.target}: published by another writer first"
                ) from None
            raise
        _fsync_dir(self.target.parent)
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)

    def abort(self) -> None:
        """Drop everything written so far (idempotent)."""
        if self._done:
            return
        self._tokens.close()
        self._mask.close()
        shutil.rmtree(self.tmp, ignore_errors=True)
        self._done = True

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is not None or not self._done:
            self.abort()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
