"""`python -m trainer.data import|synth|info|show`: build and inspect token stores.

Exit codes: 0 ok; 2 usage or input error (one line on stderr naming the file, line or option;
nothing is written); 130 interrupted (nothing is written); 1 unexpected failure (traceback).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType
from typing import Any

import numpy as np

from trainer.data.errors import InputError
from trainer.data.store import LineStat, Manifest, StoreError, TokenStore
from trainer.errors import ExitCode

PROGRESS_EVERY_S = 10.0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.data", description=__doc__.split("\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)

    imp = sub.add_parser(
        "import", help="tokenise chat JSONL with a local tokenizer's chat template"
    )
    imp.add_argument(
        "--input", required=True, help="chat JSONL, or one JSON array of rows (either may be .gz)"
    )
    imp.add_argument("--tokenizer", required=True, help="local Hugging Face tokenizer directory")
    imp.add_argument("--max-length", type=int, required=True, help="truncate rows to N tokens")
    imp.add_argument("--out", required=True, help="store directory to create")
    imp.add_argument("--chat-template", help="Jinja file overriding the tokenizer's template")
    imp.add_argument(
        "--template-kwargs",
        default="{}",
        help="JSON object passed to every render of the chat template; keywords it cannot use "
        "on a finished conversation (never read, or read only for a generation prompt, such as "
        "Qwen3's enable_thinking) are refused by name",
    )
    imp.add_argument(
        "--per-turn",
        action="store_true",
        help="one row per assistant turn (the conversation up to it, only that turn trained): "
        "trains the reasoning templates drop from history turns (Qwen3)",
    )
    imp.add_argument(
        "--workers",
        type=int,
        default=min(8, os.cpu_count() or 1),
        help="encoding processes (default: cores, at most 8); the store is the same for any N",
    )
    imp.add_argument(
        "--mask-token-id",
        type=int,
        help="record the drafter's mask id (must be >= the tokenizer's size: an unused row)",
    )
    imp.add_argument("--force", action="store_true", help="replace an existing store")

    syn = sub.add_parser("synth", help="write a learnable synthetic store")
    syn.add_argument(
        "--lengths-from", required=True, help="'seed-shaped', a .npy of lengths, or a store dir"
    )
    syn.add_argument("--vocab", type=int, required=True, help="vocabulary size V")
    syn.add_argument("--out", required=True, help="store directory to create")
    syn.add_argument(
        "--rows",
        type=int,
        help="draw N rows from the length distribution (with replacement past its size)",
    )
    syn.add_argument("--max-length", type=int, help="clip lengths to N tokens")
    syn.add_argument(
        "--length-scale", type=float, default=1.0, help="divide every length by F (shrink a shape)"
    )
    syn.add_argument("--seed", type=int, default=0)
    syn.add_argument("--mask-token-id", type=int, help="never emitted (default V-1)")
    syn.add_argument(
        "--reserved-top", type=int, default=8, help="top ids never emitted (default 8)"
    )
    syn.add_argument("--force", action="store_true", help="replace an existing store")

    info = sub.add_parser("info", help="print a store's manifest summary")
    info.add_argument("store")
    info.add_argument("--verify", action="store_true", help="also check sha256 and token ids")
    info.add_argument("--json", action="store_true", help="print the manifest as JSON")

    show = sub.add_parser("show", help="print rows with the supervised tokens marked ⟦ ⟧")
    show.add_argument("store")
    picks = show.add_mutually_exclusive_group()
    picks.add_argument("--count", type=int, default=3, help="the first N rows (default 3)")
    picks.add_argument("--rows", help="comma-separated row numbers, e.g. 0,17,42")
    show.add_argument("--tokenizer", help="tokenizer dir (default: the one in the manifest)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        if args.command == "import":
            manifest = _run_import(args)
        elif args.command == "synth":
            manifest = _run_synth(args)
        elif args.command == "show":
            return _run_show(args)
        else:
            return _run_info(args)
    except (InputError, StoreError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        print("interrupted: nothing was written", file=sys.stderr)
        return ExitCode.INTERRUPTED
    finally:
        signal.signal(signal.SIGTERM, previous)
    print(format_summary(manifest, TokenStore.open(args.out).lengths))
    return ExitCode.OK


def _raise_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # unwinds through StoreWriter, which deletes its temp dir


def _run_import(args: argparse.Namespace) -> Manifest:
    from trainer.data.chat_import import import_chat_jsonl
    from trainer.data.progress import ImportProgress

    try:
        kwargs = json.loads(args.template_kwargs)
    except json.JSONDecodeError as exc:
        raise InputError(f"--template-kwargs: not JSON ({exc.msg})") from None
    if not isinstance(kwargs, dict):
        raise InputError("--template-kwargs: must be a JSON object")
    source = Path(args.input)
    with ImportProgress(source.stat().st_size if source.is_file() else 0) as progress:
        manifest = import_chat_jsonl(
            source,
            args.tokenizer,
            args.max_length,
            args.out,
            overwrite=args.force,
            chat_template=args.chat_template,
            template_kwargs=kwargs,
            workers=args.workers,
            mask_token_id=args.mask_token_id,
            per_turn=args.per_turn,
            progress=progress.update,
        )
    print(progress.summary(), file=sys.stderr)
    return manifest


def _throttled(command: str, unit: str) -> Callable[[int, int], None]:
    """A progress callback printing to stderr at most every PROGRESS_EVERY_S seconds (synth)."""
    started = time.monotonic()
    last = [started]

    def report(done: int, other: int) -> None:
        now = time.monotonic()
        if now - last[0] < PROGRESS_EVERY_S:
            return
        last[0] = now
        rate = done / max(now - started, 1e-9)
        print(f"{command}: {done:,} {unit} of {other:,}, {rate:,.0f} {unit}/s", file=sys.stderr)

    return report


def _run_synth(args: argparse.Namespace) -> Manifest:
    from trainer.data.synth import synth_store

    if args.vocab < 1:
        raise InputError(f"--vocab {args.vocab}: must be positive")
    return synth_store(
        args.out,
        lengths_from=args.lengths_from,
        vocab_size=args.vocab,
        rows=args.rows,
        max_length=args.max_length,
        seed=args.seed,
        mask_token_id=args.mask_token_id,
        reserved_top=args.reserved_top,
        length_scale=args.length_scale,
        overwrite=args.force,
        progress=_throttled("synth", "rows"),
    )


def _run_info(args: argparse.Namespace) -> int:
    try:
        store = TokenStore.open(args.store, verify=args.verify)
    except StoreError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    if args.json:
        print(store.manifest.model_dump_json(indent=2))
    else:
        print(format_summary(store.manifest, store.lengths, path=str(store.path)))
        if args.verify:
            print("verify     ok: sizes, sha256, token ids, mask")
    return ExitCode.OK


def _run_show(args: argparse.Namespace) -> int:
    from trainer.data.show import id_decoder, render_row, tokenizer_decoder

    store = TokenStore.open(args.store)
    try:
        rows = (
            [int(r) for r in args.rows.split(",")]
            if args.rows
            else list(range(min(args.count, len(store))))
        )
    except ValueError:
        raise InputError(f"--rows {args.rows!r}: expected comma-separated integers") from None
    bad = [r for r in rows if not 0 <= r < len(store)]
    if bad:
        raise InputError(f"--rows: {bad[0]} is outside 0..{len(store) - 1} of {store.path}")
    tok_dir = args.tokenizer or (store.manifest.tokenizer and store.manifest.tokenizer.name_or_path)
    decode = tokenizer_decoder(tok_dir) if tok_dir else id_decoder
    for r in rows:
        tokens, mask = store.row(r)
        line = store.source_line(r)
        where = f" (input line {line})" if line is not None else ""
        print(f"--- row {r}{where}: {tokens.size} tokens, {int(mask.sum())} supervised")
        print(render_row(tokens, mask, decode))
    return ExitCode.OK


def format_summary(m: Manifest, lengths: np.ndarray, path: str | None = None) -> str:
    """Human summary of a store; the first thing to read after an import."""
    lines = []
    if path:
        lines.append(f"store      {path}")
    lines.append(
        f"kind       {m.kind} (format {m.format_version}, created {m.created_at:%Y-%m-%d %H:%M:%SZ})"
    )
    src = f"source     {m.source}"
    if m.params.get("source_format") == "json-array":
        src += "  (one JSON array)"
    if m.source_sha256:
        src += f"  sha256 {m.source_sha256[:12]}"
    lines.append(src)
    if m.tokenizer:
        t = m.tokenizer
        lines.append(f"tokenizer  {t.name_or_path}  {t.class_name}  sha256 {t.sha256[:12]}")
    share = m.num_supervised_tokens / m.num_tokens if m.num_tokens else 0.0
    lines.append(
        f"rows       {m.num_rows:,}  tokens {m.num_tokens:,}  supervised {m.num_supervised_tokens:,} "
        f"({share:.1%})  vocab {m.vocab_size:,}"
    )
    if lengths.size:
        p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
        lines.append(
            f"lengths    min {int(lengths.min())}  p50 {p50:.0f}  p90 {p90:.0f}  p99 {p99:.0f}  "
            f"max {int(lengths.max())}  (max_length {m.max_length})"
        )
    lines.append(f"mask       {m.mask_strategy}{_unlocated(m.params)}")
    reasoning = _reasoning(m.params)
    if reasoning:
        lines.append(f"reasoning  {reasoning}")
    lines.extend(_think_in_content(m.params))
    lines.extend(_served(m.params))
    if m.truncated.count:
        lines.append(
            f"truncated  {m.truncated.count:,} rows kept after truncation ({_where(m.truncated)})"
        )
    if m.skipped:
        lines.append(f"skipped    {m.num_skipped:,} rows")
        for reason, stat in sorted(m.skipped.items(), key=lambda kv: -kv[1].count):
            lines.append(f"  {reason:<36} {stat.count:>9,}  ({_where(stat)})")
            lines.extend(f"      {example}" for example in stat.examples)
    if m.reserved_token_ids:
        lines.append(
            f"reserved   never emitted: {_ranges(m.reserved_token_ids)}  mask token {m.mask_token_id}"
        )
    return "\n".join(lines)


def _unlocated(params: dict[str, Any]) -> str:
    n = params.get("unlocated_turns")
    return f"; {n} assistant turns not found in the rendering (unsupervised)" if n else ""


def _reasoning(params: dict[str, Any]) -> str:
    turns, dropped = params.get("reasoning_turns", 0), params.get("reasoning_dropped", 0)
    expanded = params.get("expanded_rows", 0)
    parts = []
    if turns:
        parts.append(f"{turns:,} trained assistant turns carry reasoning")
    if dropped:
        hint = "" if params.get("per_turn") else "; --per-turn trains them"
        parts.append(f"the template dropped it from {dropped:,} (history turns{hint})")
    if expanded:
        parts.append(f"--per-turn added {expanded:,} rows")
    return "; ".join(parts)


def _think_in_content(params: dict[str, Any]) -> list[str]:
    """Rows whose plain assistant content holds `</think>`: the template made a think block of
    the text before it (trained as reasoning), silently unless said here."""
    raw = params.get("think_in_content")
    stat = LineStat.model_validate(raw) if isinstance(raw, dict) else LineStat()
    if not stat.count:
        return []
    return [
        f"think      {stat.count:,} rows have '</think>' inside plain assistant content: the "
        f"template made a think block of the text before it, trained as reasoning ({_where(stat)})",
        *(f"      {example}" for example in stat.examples[:1]),
    ]


def _served(params: dict[str, Any]) -> list[str]:
    """A regenerated input: how its rows were made, and the rows built from the server's ids
    with how many of them the template's own rendering would have tokenised differently."""
    out = []
    regen = params.get("regen")
    if isinstance(regen, dict):
        kwargs = json.dumps(regen.get("chat_template_kwargs", {}), sort_keys=True)
        out.append(
            f"regen      --reasoning {regen.get('reasoning')} (chat_template_kwargs {kwargs}), "
            f"model {regen.get('model')}"
        )
    rows = params.get("served_rows", 0)
    if rows:
        raw = params.get("served_differs")
        stat = LineStat.model_validate(raw) if isinstance(raw, dict) else LineStat()
        differs = (
            f"; the template's re-rendering differs in {stat.count:,} ({_where(stat)})"
            if stat.count
            else "; the template's re-rendering matches every one"
        )
        out.append(
            f"served     {rows:,} rows from the server's token ids (one per generation){differs}"
        )
        out.extend(f"      {example}" for example in stat.examples[:2])
    return out


def _where(stat: LineStat) -> str:
    more = ", ..." if stat.count > len(stat.first_lines) else ""
    return "lines " + ", ".join(map(str, stat.first_lines)) + more


def _ranges(ids: list[int]) -> str:
    parts: list[str] = []
    start = prev = ids[0]
    for i in [*ids[1:], None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        parts.append(f"{start}" if start == prev else f"{start}..{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(parts)
