"""`python -m trainer.regen`: regenerate a chat file's assistant turns with the target, through
OpenAI-compatible servers, in the thinking mode it will be served in (see trainer/regen).

    python -m trainer.regen --input chats.jsonl --server http://127.0.0.1:8000 \\
        --out regen.jsonl --reasoning disable [--concurrency 64] [--resume]

Every flag is checked before anything connects (one line naming it, exit 2). Exit codes: 0 every
row ended (in OUT or OUT.errors.jsonl); 1 the servers stayed away for --wait-s, or a write
failed; 2 a usage or input error, or the first rows all failed alike; 130 SIGINT/SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from trainer.data.served import ON_LENGTH, REASONING_MODES, RegenManifest
from trainer.errors import ExitCode, TrainerError
from trainer.regen.replies import MODE_KWARGS

# Request fields regeneration sets itself: --sampling may not name them.
RESERVED = frozenset(
    {"model", "messages", "tools", "max_tokens", "temperature", "stream", "n"}
    | {"chat_template_kwargs", "return_token_ids"}
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m trainer.regen", description=__doc__.split("\n")[0])
    p.add_argument(
        "--input",
        nargs="+",
        required=True,
        type=Path,
        metavar="FILE",
        help="chat files in any format `trainer.data import` reads (JSONL, a JSON array, .gz)",
    )
    p.add_argument(
        "--server",
        action="append",
        required=True,
        metavar="URL",
        help="an OpenAI-compatible server, e.g. http://127.0.0.1:8000 (repeat for more)",
    )
    p.add_argument(
        "--model", default="", help="the served model name (default: the first server's first)"
    )
    p.add_argument(
        "--out", required=True, type=Path, help="OUT.jsonl; failures go to OUT.errors.jsonl"
    )
    p.add_argument(
        "--concurrency", type=int, default=64, help="requests in flight per server (default 64)"
    )
    p.add_argument("--max-tokens", type=int, default=4096, help="per reply (default 4096)")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument(
        "--reasoning",
        choices=REASONING_MODES,
        default="none",
        help="none: the server's default mode; save: thinking on, reasoning kept; "
        "disable: thinking off, a reply that still thinks is rejected",
    )
    p.add_argument(
        "--template-kwargs",
        default="{}",
        help="JSON object sent as chat_template_kwargs (with the --reasoning mode's)",
    )
    p.add_argument(
        "--sampling",
        default="{}",
        help='JSON object of more request fields, e.g. \'{"top_p": 0.95, "seed": 0}\'',
    )
    p.add_argument(
        "--on-length",
        choices=ON_LENGTH,
        default="keep",
        help="a reply cut at --max-tokens: keep the row (marked), or drop it to the errors file",
    )
    p.add_argument(
        "--resume", action="store_true", help="skip rows already in OUT or its errors file"
    )
    p.add_argument("--limit", type=int, help="only the first N usable rows of the input")
    p.add_argument(
        "--max-retries", type=int, default=8, help="failed requests retried per row (default 8)"
    )
    p.add_argument(
        "--request-timeout-s",
        type=float,
        default=1800.0,
        help="a request without an answer for this long is retried (default 1800)",
    )
    p.add_argument(
        "--wait-s",
        type=float,
        default=3600.0,
        help="give up when no server answers for this long (default 3600)",
    )
    p.add_argument("--backoff-s", type=float, default=1.0, help="first retry backoff (default 1)")
    p.add_argument(
        "--status-interval-s", type=float, default=30.0, help="seconds between status lines"
    )
    p.add_argument("--run-dir", type=Path, help="also append the status lines to RUN/status.log")
    p.add_argument(
        "--no-token-ids",
        action="store_true",
        help="do not ask for token ids (return_token_ids: for servers that refuse it)",
    )
    return p


class UsageError(TrainerError):
    exit_code = ExitCode.USAGE


def _json_object(flag: str, text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as err:
        raise UsageError(f"{flag}: not JSON ({err.msg} at column {err.colno})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{flag}: must be a JSON object")
    return value


def _check(args: argparse.Namespace) -> None:
    for path in args.input:
        if not path.is_file():
            raise UsageError(f"--input {path}: no such file")
    for url in args.server:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise UsageError(f"--server {url!r}: not an http(s)://HOST:PORT URL")
    for flag, value, low in (
        ("--concurrency", args.concurrency, 1),
        ("--max-tokens", args.max_tokens, 1),
        ("--max-retries", args.max_retries, 0),
        ("--limit", args.limit, 1),
    ):
        if value is not None and value < low:
            raise UsageError(f"{flag} {value}: must be >= {low}")
    for flag, seconds in (
        ("--request-timeout-s", args.request_timeout_s),
        ("--wait-s", args.wait_s),
        ("--backoff-s", args.backoff_s),
        ("--status-interval-s", args.status_interval_s),
    ):
        if not 0 < seconds < float("inf"):
            raise UsageError(f"{flag} {seconds}: must be a positive number")
    if not 0 <= args.temperature < float("inf"):
        raise UsageError(f"--temperature {args.temperature}: must be >= 0")
    if len(set(args.server)) != len(args.server):
        raise UsageError("--server: a URL is given twice")


def manifest_and_body(args: argparse.Namespace) -> tuple[RegenManifest, dict[str, Any]]:
    """The manifest the output opens with, and the fixed part of every request."""
    kwargs = _json_object("--template-kwargs", args.template_kwargs)
    sampling = _json_object("--sampling", args.sampling)
    for key, value in MODE_KWARGS[args.reasoning].items():
        if key in kwargs and kwargs[key] != value:
            raise UsageError(
                f"--template-kwargs {key}={json.dumps(kwargs[key])} contradicts --reasoning "
                f"{args.reasoning} (which sends {key}={json.dumps(value)})"
            )
    kwargs = {**kwargs, **MODE_KWARGS[args.reasoning]}
    taken = [k for k in sampling if k in RESERVED]
    if taken:
        raise UsageError(f"--sampling: {', '.join(taken)} is set by trainer.regen itself")
    manifest = RegenManifest(
        model=args.model,
        reasoning=args.reasoning,
        chat_template_kwargs=kwargs,
        temperature=args.temperature,
        max_tokens=args.max_tokens,
        on_length=args.on_length,
        sampling=sampling,
        created_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    )
    body = {**sampling, "max_tokens": args.max_tokens, "temperature": args.temperature}
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    if not args.no_token_ids:
        body["return_token_ids"] = True
    return manifest, body


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        _check(args)
        manifest, body = manifest_and_body(args)
    except UsageError as err:
        print(f"error: {err}", file=sys.stderr)
        return ExitCode.USAGE
    from trainer.regen.job import Console, JobConfig, run_job  # httpx: after the flags

    cfg = JobConfig(
        inputs=list(args.input),
        servers=[u.rstrip("/") for u in args.server],
        out=args.out,
        manifest=manifest,
        concurrency=args.concurrency,
        resume=args.resume,
        limit=args.limit,
        max_retries=args.max_retries,
        request_timeout_s=args.request_timeout_s,
        wait_s=args.wait_s,
        status_interval_s=args.status_interval_s,
        backoff_s=args.backoff_s,
        token_ids=not args.no_token_ids,
        run_dir=args.run_dir,
        body=body,
    )
    console = Console(args.run_dir, sys.stdout)
    try:
        return asyncio.run(run_job(cfg, console))
    except TrainerError as err:
        from trainer.events import format_error_line

        console.say(format_error_line(err.one_line()))
        return int(err.exit_code)
    finally:
        console.close()
