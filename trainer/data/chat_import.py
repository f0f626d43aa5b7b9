"""Import chat JSONL into a token store (`python -m trainer.data import`).

A bad row never stops the import: it is counted under a reason with its line number, and the
first few line numbers plus the first details of every kind (the offending role, key, part type
or character; `store.LineStat`) land in the manifest, so a 900k-row import that loses 3% of its
rows says which rows and why. Only problems with the whole input (missing file, unloadable
tokenizer, no usable row at all) are errors, and then nothing is written.
"""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import sys
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data.chat_mask import ChatEncoder, Encoded
from trainer.data.conversations import Conversation, MetaRow, Rejected, expand_turns, served_turns
from trainer.data.errors import InputError
from trainer.data.served import RegenManifest
from trainer.data.served_import import (
    BAD_TOKEN_ID,
    check_kwargs,
    check_later_manifest,
    file_manifest,
    rerender_difference,
    served_sample,
)
from trainer.data.sources import ChatSource
from trainer.data.store import (
    LineStat,
    Manifest,
    StoreWriter,
    TokenizerIdentity,
    check_target,
    sha256_file,
)
from trainer.data.template_kwargs import inert_template_kwargs

NO_SUPERVISED_PAIR = "no_supervised_pair"
NO_SUPERVISED_PAIR_AFTER_TRUNCATION = "no_supervised_pair_after_truncation"

# Files that define a Hugging Face tokenizer's behaviour; their hashes identify it.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
)

# (bytes of the input read, rows read, rows kept): zeros once reading begins, then per chunk
Progress = Callable[[int, int, int], None]


@dataclass
class ImportStats:
    """Per-reason counts accumulated while streaming the input."""

    lines: int = 0
    rows: int = 0  # rows read (kept or not; blank lines aside)
    blank_lines: int = 0
    unlocated_turns: int = 0
    reasoning_turns: int = 0  # assistant turns with reasoning in the kept conversations
    reasoning_dropped: int = 0  # ... of which the template rendered no reasoning (history)
    expanded_rows: int = 0  # extra rows made by per-turn expansion
    manifest_lines: int = 0  # a regenerated file's manifest line(s): not rows
    served_rows: int = 0  # store rows built from a server's token ids (one per generation)
    served_differs: LineStat = field(default_factory=LineStat)  # ... whose re-render differs
    skipped: dict[str, LineStat] = field(default_factory=dict)
    truncated: LineStat = field(default_factory=LineStat)
    think_in_content: LineStat = field(default_factory=LineStat)  # kept rows, see chat_mask

    def skip(self, reason: str, line: int, detail: str | None = None) -> None:
        self.skipped.setdefault(reason, LineStat()).add(line, detail)

    def summary(self) -> str:
        parts = [f"{r}={s.count} ({describe(s)})" for r, s in sorted(self.skipped.items())]
        return "; ".join(parts) or "nothing skipped"


def describe(stat: LineStat) -> str:
    """`lines 1, 4, 8, ...; line 1: role 'function_call'; line 4: role 'observation'`."""
    more = ", ..." if stat.count > len(stat.first_lines) else ""
    text = "lines " + ", ".join(map(str, stat.first_lines)) + more
    return "; ".join([text, *stat.examples])


def has_supervised_pair(mask: np.ndarray) -> bool:
    """True when some position and its successor are both supervised (an anchor needs that)."""
    return bool(np.any(mask[:-1] & mask[1:])) if mask.size > 1 else False


def unsupervised_detail(mask: np.ndarray, max_length: int) -> str:
    """Why a row trains nothing: its length, and where supervision began (if anywhere)."""
    supervised = np.flatnonzero(mask)
    if mask.size > max_length:
        where = (
            f"supervision begins at token {int(supervised[0])}"
            if supervised.size
            else "nothing supervised"
        )
        return f"{mask.size} tokens cut to --max-length {max_length}; {where}"
    if not supervised.size:
        return f"{mask.size} tokens, none supervised"
    return f"{mask.size} tokens, {supervised.size} supervised, never two in a row"


def load_tokenizer(directory: Path, chat_template: Path | None = None) -> Any:
    """Load a local Hugging Face tokenizer; never touches the network."""
    if not directory.is_dir():
        raise InputError(f"{directory}: tokenizer directory not found")
    from transformers import AutoTokenizer  # heavy; only the import command needs it

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as exc:
        raise InputError(f"{directory}: cannot load tokenizer: {_one_line(exc)}") from None
    if chat_template is not None:
        tokenizer.chat_template = read_chat_template(chat_template)
    return tokenizer


def read_chat_template(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"{path}: cannot read chat template: {_one_line(exc)}") from None


def tokenizer_identity(
    directory: Path, tokenizer: Any, chat_template: Path | None = None
) -> TokenizerIdentity:
    """Name + per-file sha256 of the tokenizer, so a store can be matched to its target."""
    files = {
        name: sha256_file(directory / name)
        for name in TOKENIZER_FILES
        if (directory / name).is_file()
    }
    if chat_template is not None:
        files["chat_template (override)"] = sha256_file(chat_template)
    combined = hashlib.sha256()
    for name in sorted(files):
        combined.update(f"{name}\0{files[name]}\n".encode())
    return TokenizerIdentity(
        name_or_path=str(directory.absolute()),
        class_name=type(tokenizer).__name__,
        sha256=combined.hexdigest(),
        files=files,
    )


def import_chat_jsonl(
    input_path: str | os.PathLike[str],
    tokenizer_dir: str | os.PathLike[str],
    max_length: int,
    out: str | os.PathLike[str],
    *,
    overwrite: bool = False,
    chat_template: str | os.PathLike[str] | None = None,
    template_kwargs: dict[str, Any] | None = None,
    chunk_rows: int = 256,
    workers: int = 1,
    mask_token_id: int | None = None,
    per_turn: bool = False,
    progress: Progress | None = None,
) -> Manifest:
    """Stream `input_path` (JSONL or one JSON array) through the chat template into `out`.

    Rows are encoded in chunks of `chunk_rows` (one batched tokenizer call each), by `workers`
    processes when > 1; the store is identical for any worker count because chunks are written
    back in input order. A row longer than `max_length` keeps its first `max_length` tokens and
    is counted as truncated.

    `mask_token_id`, when given, is recorded for the drafter; it must lie past the tokenizer's
    ids (an unused embedding row, e.g. 151669 for Qwen3), so no row can contain it.

    `per_turn` writes one row per assistant turn (the conversation up to it, only that turn
    supervised), so templates that drop history reasoning (Qwen3) still train every turn's.
    Each row keeps its source line (`TokenStore.source_line`).
    """
    source = Path(input_path)
    tok_dir = Path(tokenizer_dir)
    template_path = Path(chat_template) if chat_template is not None else None
    if max_length < 2:
        raise InputError(f"--max-length {max_length}: must be at least 2")
    if not source.is_file():
        raise InputError(f"{source}: input file not found")
    if workers < 1:
        raise InputError(f"--workers {workers}: must be at least 1")
    check_target(out, overwrite)
    if template_path is not None:  # every input is checked before transformers loads (slow)
        read_chat_template(template_path)
    regen = file_manifest(source)
    declared = check_kwargs(source, regen, dict(template_kwargs or {})) if regen else set()
    tokenizer = load_tokenizer(tok_dir, template_path)
    try:
        encoder = ChatEncoder(tokenizer, template_kwargs)
    except ValueError as exc:
        raise InputError(f"{tok_dir}: {_one_line(exc)}") from None
    undeclared = {k: v for k, v in encoder.template_kwargs.items() if k not in declared}
    if undeclared:
        try:
            inert = inert_template_kwargs(_templates(tokenizer), undeclared)
        except Exception as exc:  # jinja2.TemplateSyntaxError and friends
            where = template_path or tok_dir
            raise InputError(f"{where}: chat template does not parse: {_one_line(exc)}") from None
        if inert:
            raise InputError(f"--template-kwargs: {'; '.join(inert)}")
    if mask_token_id is not None and mask_token_id < len(tokenizer):
        piece = tokenizer.convert_ids_to_tokens(mask_token_id) if mask_token_id >= 0 else None
        raise InputError(
            f"--mask-token-id {mask_token_id}: is token {piece!r} of {tok_dir}; choose an id "
            f">= {len(tokenizer)} (an unused embedding row) so no row can contain it"
        )
    identity = tokenizer_identity(tok_dir, tokenizer, template_path)
    stats = ImportStats()
    lines = ChatSource(source)
    with StoreWriter(out, overwrite=overwrite) as writer:
        if progress is not None:
            progress(0, 0, 0)  # reading begins
        chunks = _parsed_chunks(lines, stats, chunk_rows, per_turn, regen)
        vocab = len(tokenizer)
        for chunk, results in encode_chunks(chunks, encoder, workers):
            for (line, conversation), result in zip(chunk, results, strict=True):
                if conversation.served is not None:
                    _store_served(writer, stats, line, conversation, result, max_length, vocab)
                else:
                    _store_row(writer, stats, line, result, max_length)
            if progress is not None:
                progress(lines.bytes_read(), stats.rows, writer.num_rows)
        if progress is not None:  # the rows after the last chunk were all skipped
            progress(source.stat().st_size, stats.rows, writer.num_rows)
        if writer.num_rows == 0:
            raise InputError(f"{source}: no usable rows in {stats.lines} lines ({stats.summary()})")
        return writer.commit(
            kind="chat-import",
            source=str(source.absolute()),
            source_sha256=lines.file_sha256(),
            tokenizer=identity,
            vocab_size=len(tokenizer),
            max_length=max_length,
            skipped=stats.skipped,
            truncated=stats.truncated,
            mask_strategy=encoder.strategy,
            mask_token_id=mask_token_id,
            reserved_token_ids=[] if mask_token_id is None else [mask_token_id],
            params={
                "lines": stats.lines,
                "rows_read": stats.rows,
                "blank_lines": stats.blank_lines,
                "unlocated_turns": stats.unlocated_turns,
                "reasoning_turns": stats.reasoning_turns,
                "reasoning_dropped": stats.reasoning_dropped,
                "per_turn": per_turn,
                "expanded_rows": stats.expanded_rows,
                "think_in_content": stats.think_in_content.model_dump(),
                "source_format": lines.format,
                "template_kwargs": encoder.template_kwargs,
                "chat_template": str(template_path.absolute()) if template_path else None,
                "regen": regen.model_dump(mode="json") if regen else None,
                "served_rows": stats.served_rows,
                "served_differs": stats.served_differs.model_dump(),
            },
        )


Chunk = list[tuple[int, Conversation]]  # (line number, conversation) in input order


def _templates(tokenizer: Any) -> list[str]:
    template = tokenizer.chat_template
    return list(template.values()) if isinstance(template, dict) else [str(template)]


def _parsed_chunks(
    rows: ChatSource,
    stats: ImportStats,
    chunk_rows: int,
    per_turn: bool,
    regen: RegenManifest | None = None,
) -> Iterator[Chunk]:
    """Parse rows, count rejects on the spot, and group good rows into chunks. A row with the
    server's ids becomes one conversation per generation (`served_turns`), whatever
    `per_turn` says; a regenerated file's manifest line is not a row."""
    pending: Chunk = []
    for line, parsed in rows:
        stats.lines = rows.lines
        if isinstance(parsed, MetaRow):
            if regen is None or line != 1:
                check_later_manifest(rows.path, line, regen or _no_manifest(rows.path), parsed)
            stats.manifest_lines += 1
            continue
        stats.rows += parsed is not None
        if parsed is None:
            stats.blank_lines += 1
        elif isinstance(parsed, Rejected):
            stats.skip(parsed.reason, line, parsed.detail)
        else:
            if parsed.served is not None:
                expanded = served_turns(parsed)
            else:
                expanded = expand_turns(parsed) if per_turn else [parsed]
                stats.expanded_rows += len(expanded) - 1
            pending.extend((line, conversation) for conversation in expanded)
            if len(pending) >= chunk_rows:
                yield pending
                pending = []
    if pending:
        yield pending


_WORKER_ENCODER: ChatEncoder | None = None


def _init_worker(encoder: ChatEncoder) -> None:
    # Ctrl-C reaches the whole process group: let the parent alone decide to stop (it cancels
    # queued chunks and removes the temp store) instead of workers dying mid-chunk.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    global _WORKER_ENCODER
    _WORKER_ENCODER = encoder


def _encode_in_worker(conversations: list[Conversation]) -> list[Encoded | Rejected]:
    assert _WORKER_ENCODER is not None, "worker used without its initializer"
    return _WORKER_ENCODER.encode_batch(conversations)


def encode_chunks(
    chunks: Iterator[Chunk], encoder: ChatEncoder, workers: int
) -> Iterator[tuple[Chunk, list[Encoded | Rejected]]]:
    """Encode chunks in order, in this process or in a pool with a bounded in-flight window.

    Workers are forked on Linux (the loaded tokenizer is inherited, no re-import); each runs
    the Rust tokenizer single-threaded, so processes rather than threads share the cores.
    """
    if workers <= 1:
        for chunk in chunks:
            yield chunk, encoder.encode_batch([messages for _, messages in chunk])
        return
    method = "fork" if sys.platform == "linux" else "spawn"
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    pool = ProcessPoolExecutor(
        workers,
        mp_context=multiprocessing.get_context(method),
        initializer=_init_worker,
        initargs=(encoder,),
    )
    window: deque[tuple[Chunk, Future[list[Encoded | Rejected]]]] = deque()
    try:
        for chunk in chunks:
            window.append((chunk, pool.submit(_encode_in_worker, [m for _, m in chunk])))
            if len(window) >= 2 * workers:
                done, future = window.popleft()
                yield done, future.result()
        while window:
            done, future = window.popleft()
            yield done, future.result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
        if saved is None:
            os.environ.pop("TOKENIZERS_PARALLELISM", None)
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved


def _store_row(
    writer: StoreWriter,
    stats: ImportStats,
    line: int,
    result: Encoded | Rejected,
    max_length: int,
) -> None:
    if isinstance(result, Rejected):
        stats.skip(result.reason, line, result.detail)
        return
    stats.unlocated_turns += result.unlocated_turns
    stats.reasoning_turns += result.reasoning_turns
    stats.reasoning_dropped += result.reasoning_dropped
    tokens, mask = result.tokens, result.mask
    truncated = tokens.size > max_length
    if truncated:
        tokens, mask = tokens[:max_length], mask[:max_length]
    if not has_supervised_pair(mask):
        reason = NO_SUPERVISED_PAIR_AFTER_TRUNCATION if truncated else NO_SUPERVISED_PAIR
        stats.skip(reason, line, unsupervised_detail(result.mask, max_length))
        return
    if truncated:
        stats.truncated.add(line)
    if result.think_in_content is not None:
        stats.think_in_content.add(line, result.think_in_content)
    writer.add(tokens, mask, source_line=line)


def _no_manifest(source: Path) -> RegenManifest:
    raise InputError(
        f"{source}: a regeneration manifest line past line 1 in a file that does not open with "
        "one: the file joins regenerated rows with others; import them separately"
    )


def _store_served(
    writer: StoreWriter,
    stats: ImportStats,
    line: int,
    conversation: Conversation,
    rendered: Encoded | Rejected,
    max_length: int,
    vocab_size: int,
) -> None:
    """One generation of a regenerated row, from the server's ids (`served_sample`); the
    template's rendering of the same turn only decides the "re-render differs" count."""
    try:
        tokens, mask = served_sample(conversation, vocab_size)
    except ValueError as exc:
        stats.skip(BAD_TOKEN_ID, line, _one_line(exc))
        return
    generation = sum(m["role"] == "assistant" for m in conversation.messages)
    differs = (
        f"template: {rendered.detail}"
        if isinstance(rendered, Rejected)
        else rerender_difference(tokens, rendered)
    )
    if differs is not None:
        stats.served_differs.add(line, f"generation {generation}: {differs}")
    truncated = tokens.size > max_length
    if truncated:
        tokens, mask = tokens[:max_length], mask[:max_length]
    if not has_supervised_pair(mask):
        reason = NO_SUPERVISED_PAIR_AFTER_TRUNCATION if truncated else NO_SUPERVISED_PAIR
        stats.skip(reason, line, unsupervised_detail(mask, max_length))
        return
    if truncated:
        stats.truncated.add(line)
    stats.served_rows += 1
    writer.add(tokens, mask, source_line=line)


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:300]
