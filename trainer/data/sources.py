"""Rows of a chat file, each with its 1-based source line: JSONL, or one JSON array.

FastChat, ShareGPT dumps and LLaMA-Factory's demos ship one JSON array (`[{...}, {...}]`)
instead of JSONL. A file whose first value opens an array of objects is read element by element
with `json.JSONDecoder.raw_decode` over 1 MiB text chunks, so a multi-GB array never sits in
memory whole; each row's line is the line its element starts on. A broken array cannot be
resynchronised, so the rows before the break are kept and the break is one `malformed_json`
row at its line. Plain and gzip-compressed files (`.gz`) are accepted; the sha256 is that of the
file as stored.
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any, cast

from trainer.data.conversations import (
    MALFORMED_JSON,
    NOT_UTF8,
    Conversation,
    MetaRow,
    Rejected,
    json_error,
    normalise_conversation,
    parse_line,
)
from trainer.data.errors import InputError
from trainer.data.store import sha256_file

Parsed = Conversation | Rejected | MetaRow | None  # None: a blank line (ignored)
CHUNK_CHARS = 1 << 20
PARSE_ERROR = "parse_error"
PROBE_BYTES = 1 << 16
MAX_ELEMENT_CHARS = 1 << 28  # one row past 256 Mi characters is a broken array, not a row
_WS = re.compile(r"[ \t\n\r]*")


def _skip_ws(buf: str, pos: int = 0) -> int:
    """Index of the first non-JSON-whitespace character at or after `pos`."""
    m = _WS.match(buf, pos)
    return m.end() if m else pos  # `_WS` matches the empty string, so m is never None


class ChatSource:
    """Iterate (line number, parsed row) over a chat file, hashing its bytes as read."""

    def __init__(self, path: Path, chunk_chars: int = CHUNK_CHARS) -> None:
        self.path = path
        self.chunk_chars = chunk_chars
        self.digest = hashlib.sha256()
        self.format = "jsonl"
        self.lines = 0  # lines read so far (JSONL) or the line of the last element (array)
        self._raw: IO[bytes] | None = None  # the file as stored (compressed for .gz)

    def bytes_read(self) -> int:
        """How far into the file as stored the reader is (progress against its size)."""
        raw = self._raw
        if raw is None or raw.closed:
            return 0
        return raw.tell()

    def file_sha256(self) -> str:
        """sha256 of the file as stored (what `sha256sum` prints), compressed or not."""
        return sha256_file(self.path) if self.path.suffix == ".gz" else self.digest.hexdigest()

    def __iter__(self) -> Iterator[tuple[int, Parsed]]:
        try:
            with open(self.path, "rb") as raw, self._reader(raw) as fh:
                first = fh.readline(PROBE_BYTES)  # bounded: a one-line array may be GBs
                self.digest.update(first)
                if _is_array_start(first):
                    try:
                        self.format = "json-array"
                        yield from self._array(first, fh)
                        return
                    except _NotAnArray:  # broke before its first row: JSONL after all
                        pass
                    self.format = "jsonl"
                    self.digest = hashlib.sha256()
                    fh.seek(0)
                    first = fh.readline(PROBE_BYTES)
                    self.digest.update(first)
                if first and not first.endswith(b"\n"):
                    rest = fh.readline()
                    self.digest.update(rest)
                    first += rest
                yield from self._jsonl(first, fh)
        except (OSError, EOFError) as exc:  # unreadable, or a truncated .gz
            raise InputError(f"{self.path}: read failed: {' '.join(str(exc).split())}") from None

    def _reader(self, raw: IO[bytes]) -> IO[bytes]:
        self._raw = raw
        if self.path.suffix == ".gz":
            return cast(IO[bytes], gzip.GzipFile(fileobj=raw, mode="rb"))  # reads like IO[bytes]
        return raw

    def _jsonl(self, first: bytes, fh: IO[bytes]) -> Iterator[tuple[int, Parsed]]:
        if first:
            self.lines = 1
            yield 1, _parse(first)
        for number, raw in enumerate(fh, start=2):
            self.digest.update(raw)
            self.lines = number
            yield number, _parse(raw)

    def _array(self, first: bytes, fh: IO[bytes]) -> Iterator[tuple[int, Parsed]]:
        decoder = codecs.getincrementaldecoder("utf-8")("strict")
        raw_decode = json.JSONDecoder().raw_decode
        try:
            buf = decoder.decode(first).removeprefix("\ufeff")
        except UnicodeDecodeError:
            raise _NotAnArray from None
        elements = 0
        pos = _skip_ws(buf) + 1  # past '['
        line = 1 + buf.count("\n", 0, pos)
        eof = False

        def more() -> bool:
            nonlocal buf, eof
            data = fh.read(self.chunk_chars)
            self.digest.update(data)
            eof = not data
            try:
                buf += decoder.decode(data, final=eof)
            except UnicodeDecodeError as exc:
                raise _Broken(NOT_UTF8, f"invalid UTF-8 at byte {exc.start}") from None
            return not eof

        try:
            expect_value = True
            while True:
                skip = _skip_ws(buf, pos)
                line += buf.count("\n", pos, skip)
                pos = skip
                if pos >= len(buf):
                    if eof or not more():
                        raise _Broken(MALFORMED_JSON, "the array is not closed (truncated file?)")
                    continue
                char = buf[pos]
                if char == "]" and not expect_value:
                    break
                if char == "]" and expect_value and not elements:
                    break  # an empty array
                if char == "," and not expect_value:
                    pos += 1
                    expect_value = True
                    continue
                if not expect_value:
                    raise _Broken(
                        MALFORMED_JSON, f"expecting ',' or ']' at column {_col(buf, pos)}"
                    )
                try:
                    value, end = raw_decode(buf, pos)
                except json.JSONDecodeError as exc:
                    if len(buf) - pos < MAX_ELEMENT_CHARS and not eof and more():
                        continue  # the element runs past the chunk: read on and retry
                    raise _Broken(MALFORMED_JSON, json_error(exc)) from None
                except (ValueError, RecursionError) as exc:
                    raise _Broken(MALFORMED_JSON, " ".join(str(exc).split())[:120]) from None
                if end == len(buf) and not eof and more():
                    continue  # a number may continue in the next chunk
                if not elements and not isinstance(value, dict):
                    raise _NotAnArray  # '[1, 2' opening a JSONL file is a bad row, not a format
                self.lines = line
                elements += 1
                yield line, _normalise(value)
                line += buf.count("\n", pos, end)
                pos = end
                expect_value = False
                if pos > self.chunk_chars:  # drop what has been consumed
                    buf, pos = buf[pos:], 0
        except _Broken as broken:
            if not elements:
                raise _NotAnArray from None
            self.lines = line
            yield (
                line,
                Rejected(broken.reason, f"{broken.detail}; the array is unreadable from here"),
            )
        else:  # closed: anything but whitespace after the ']' is reported, never dropped unseen
            pos += 1
            while True:
                skip = _skip_ws(buf, pos)
                line += buf.count("\n", pos, skip)
                pos = skip
                if pos < len(buf):
                    yield line, Rejected(MALFORMED_JSON, "data after the array's closing ']'")
                    break
                buf, pos = "", 0
                try:
                    if eof or not more():
                        break
                except _Broken as broken:
                    yield line, Rejected(broken.reason, f"{broken.detail} after the array")
                    break
        while not eof:  # hash the rest (trailing whitespace, or what follows a break)
            data = fh.read(self.chunk_chars)
            self.digest.update(data)
            eof = not data


def _parse(raw: bytes) -> Parsed:
    try:
        return parse_line(raw.rstrip(b"\r\n"))
    except Exception as exc:  # a parser bug must cost one row, not the import
        return Rejected(PARSE_ERROR, " ".join(f"{type(exc).__name__}: {exc}".split())[:200])


def _normalise(value: Any) -> Parsed:
    try:
        return normalise_conversation(value)
    except Exception as exc:  # as in _parse
        return Rejected(PARSE_ERROR, " ".join(f"{type(exc).__name__}: {exc}".split())[:200])


class _Broken(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason, self.detail = reason, detail


class _NotAnArray(Exception):
    pass


def _col(buf: str, pos: int) -> int:
    return pos - buf.rfind("\n", 0, pos)


def _is_array_start(first: bytes) -> bool:
    """The file opens with '[': try it as one array (falls back to JSONL if its first value is
    not an object, e.g. a JSONL file whose first row is the bad row `[1, 2, 3]`)."""
    return first.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"[")
