"""OUT and OUT.errors.jsonl: whole lines only, and what a resume finds in them.

A row is written only once its whole conversation is done, as one line by one `os.write` of
the encoded line to a file opened O_APPEND (a short write is finished by more writes), so a
reader never sees a row that is still growing and a SIGKILL loses at most the rows in flight.
A write that fails (a full disk) truncates the file back to its last whole line before
raising: a later line never follows a torn one.

A kill can still tear the one line being written (a fatal signal may end a large write
between pages). `scan` reads a file back line by line: a last line without its newline, or one
that is not a JSON object with an id, is cut off (the row is done again) and said; the ids of
the rest are the rows a resume skips. The id is read from the line's start (`{"id":"...`,
always written first) so a resume of 100k long rows does not decode them.

OUT's first line is the manifest (`trainer.data.served.RegenManifest`). A resume checks it
against this run's settings by name: a file made two ways would train two distributions.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.data.served import RegenManifest, manifest_of, resume_differences
from trainer.errors import TrainerError

_ID_AT_START = re.compile(rb'^\{"id":"([0-9a-f]{32})"')
READ_CHUNK = 1 << 20


class OutputError(TrainerError):
    """OUT or its errors file cannot be used (one line naming the file)."""


def errors_path(out: Path) -> Path:
    """OUT.errors.jsonl: `regen.jsonl` -> `regen.errors.jsonl`, `regen` -> `regen.errors.jsonl`."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.errors.jsonl")


def encode(record: dict[str, Any]) -> bytes:
    """One line: compact JSON (token ids make rows long), `id` first, a trailing newline."""
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode()


@dataclass
class Scan:
    """What a file holds: the ids of its whole lines, its manifest (OUT), what was cut off."""

    ids: set[str] = field(default_factory=set)
    manifest: RegenManifest | None = None
    lines: int = 0
    marked: int = 0  # rows holding the `marker` asked for (a length-capped row, a dropped one)
    cut_bytes: int = 0  # a torn or unreadable tail removed
    cut_reason: str = ""


def _line_id(line: bytes) -> str | None:
    found = _ID_AT_START.match(line)
    if found is not None:
        return found.group(1).decode()
    try:
        row = json.loads(line)
    except (ValueError, UnicodeDecodeError):
        return None
    rid = row.get("id") if isinstance(row, dict) else None
    return rid if isinstance(rid, str) and rid else None


def _lines(path: Path) -> Iterator[tuple[bytes, bool]]:
    """(line without its newline, whether the newline was there), read in 1 MiB chunks."""
    with open(path, "rb") as fh:
        pending = b""
        while chunk := fh.read(READ_CHUNK):
            *lines, pending = (pending + chunk).split(b"\n")
            for raw in lines:
                yield raw, True
        if pending:
            yield pending, False


def scan(path: Path, *, with_manifest: bool, marker: bytes = b"") -> Scan:
    """The ids in `path` (see the module docstring); a torn or unreadable last line is
    truncated away (`cut_bytes`). An unreadable line before the last is an OutputError."""
    found = Scan()
    if not path.exists():
        return found
    good = offset = 0  # good: the offset after the last whole, readable line
    bad: int | None = None  # the line number of an unreadable line (fine only as the last)
    for number, (raw, whole) in enumerate(_lines(path), start=1):
        offset += len(raw) + whole
        if bad is not None:
            raise OutputError(
                f"{path}:{bad}: not a row with an id (a file trainer.regen did not write?); "
                "refusing to resume into it"
            )
        if not whole:
            found.cut_reason = f"its last line ({number}) was cut short (a kill mid-write)"
            break
        if number == 1 and with_manifest:
            found.manifest = _manifest(path, raw)
        elif raw.strip():
            rid = _line_id(raw)
            if rid is None:
                bad = number
                found.cut_reason = f"its last line ({number}) is not a row"
                continue
            found.ids.add(rid)
            found.lines += 1
            found.marked += bool(marker) and marker in raw
        good = offset
    size = path.stat().st_size
    if good < size:
        found.cut_bytes = size - good
        with open(path, "r+b") as fh:
            fh.truncate(good)
    return found


def _manifest(path: Path, raw: bytes) -> RegenManifest:
    try:
        row = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        row = None
    found = manifest_of(row)
    if found is None or isinstance(found, str):
        why = found if isinstance(found, str) else "its first line is not a regeneration manifest"
        raise OutputError(f"{path}:1: {why}; not a file trainer.regen wrote")
    return found


class LineFile:
    """A file appended to by whole lines (see the module docstring)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as err:
            raise OutputError(f"{path}: cannot open for writing: {err.strerror}") from None

    def write(self, data: bytes) -> None:
        start = os.fstat(self.fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as err:
            try:
                os.ftruncate(self.fd, start)
                kept = "the file is cut back to its last whole line"
            except OSError:
                kept = "and could not be cut back: its last line is torn (a resume cuts it)"
            raise OutputError(f"{self.path}: write failed: {err.strerror}; {kept}") from None

    def close(self) -> None:
        os.close(self.fd)


def check_resume(path: Path, found: RegenManifest | None, wanted: RegenManifest) -> None:
    """A resume must continue a file made the same way (RESUME_KEYS), named key by key."""
    if found is None:
        return
    differ = resume_differences(found, wanted)
    if differ:
        raise OutputError(
            f"--resume: {path} was written with other settings: {'; '.join(differ)}; a file made "
            "two ways trains two distributions (write a new --out)"
        )
