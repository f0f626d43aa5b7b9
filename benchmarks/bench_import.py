"""Chat import with the real Qwen3 tokenizer and template: rows/s, and what isolation costs.

Run: .venv/bin/python benchmarks/bench_import.py  (about two minutes on 2 cores)

The tokenizer is the repository's test fixture (tests/fixtures/qwen3-tokenizer, unpacked to a
temp dir). Rows are generated multi-turn chats of English words, a third of them with
`reasoning_content` (which sends Qwen3 rows down the one-render-per-turn path). Measured side by
side in one run, workers=1:

- the whole import (parse + encode + write) on the real template (sentinel diff), on a copy with
  `{% generation %}` tags, and with `--per-turn`;
Times are CPU seconds of the process (tokenizer threads included, TOKENIZERS_PARALLELISM=false
so it is one core's work), so another job on the machine does not skew them; rows/s = per CPU s.

- the per-row fallback: the encoder on chunks of 256 with one row per chunk the tokenizer
  cannot encode (a lone surrogate, which the parser normally rejects first), against the same
  chunks clean. The ratio is what one poisoned row costs its chunk.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

os.environ["TOKENIZERS_PARALLELISM"] = "false"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.data.qwen3_templates import tagged_qwen3_dir
from tests.fixtures.qwen3 import unpack_qwen3_tokenizer
from trainer.data.chat_import import import_chat_jsonl, load_tokenizer
from trainer.data.chat_mask import ChatEncoder
from trainer.data.conversations import Conversation
from trainer.data.sources import ChatSource
from trainer.data.store import TokenStore

ROWS = 3_000
CHUNK = 256
TEXT = (
    "the of and to in is that for it as with was on be by this are from at or an which have "
    "not they but had his one all were there can we when been has more if will would who so "
    "model token draft target layer cache batch train loss speed answer question reason prime "
    "number because therefore first second finally result value function call weather city"
)
WORDS = TEXT.split()


def write_chats(path: Path, rng: np.random.Generator) -> None:
    with path.open("w") as fh:
        for r in range(ROWS):
            messages: list[dict[str, Any]] = []
            for _ in range(int(rng.integers(1, 4))):
                user = " ".join(rng.choice(WORDS, size=int(rng.integers(8, 40))))
                reply = " ".join(rng.choice(WORDS, size=int(rng.integers(30, 160))))
                messages += [
                    {"role": "user", "content": user.capitalize() + "?"},
                    {"role": "assistant", "content": reply.capitalize() + "."},
                ]
            if r % 3 == 0:
                for m in messages[1::2]:
                    m["reasoning_content"] = " ".join(rng.choice(WORDS, size=40))
            fh.write(json.dumps({"messages": messages}) + "\n")


R = TypeVar("R")


def timed(fn: Callable[[], R]) -> tuple[R, float]:
    """CPU seconds of this process (all its threads): robust to a shared, loaded machine."""
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


def main() -> None:
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        qwen3 = unpack_qwen3_tokenizer(tmp / "qwen3")
        tagged = tagged_qwen3_dir(qwen3, tmp / "qwen3-tagged")
        chats = tmp / "chats.jsonl"
        write_chats(chats, rng)
        print(f"# chat import, real Qwen3 tokenizer (cpus={os.cpu_count()}, workers=1)")
        print(f"{ROWS:,} chats, 1-3 exchanges, a third with reasoning_content")
        print("(CPU seconds; each import includes loading the tokenizer; best of 2 runs)\n")
        print(f"{'import':<34}{'rows/s':>9}{'tokens/s':>11}{'CPU s':>9}{'rows':>7}")
        runs = (
            ("real template (sentinel-diff)", qwen3, False),
            ("tagged copy (generation-tags)", tagged, False),
            ("real template, --per-turn", qwen3, True),
        )
        stores: dict[str, TokenStore] = {}
        for name, directory, per_turn in runs:
            out = tmp / f"s-{len(stores)}"
            secs = float("inf")
            for _ in range(2):  # best of two: the machine is shared
                manifest, took = timed(
                    functools.partial(
                        import_chat_jsonl,
                        chats,
                        directory,
                        8192,
                        out,
                        per_turn=per_turn,
                        overwrite=True,
                    )
                )
                secs = min(secs, took)
            stores[name] = TokenStore.open(out)
            print(
                f"{name:<34}{ROWS / secs:>9,.0f}{manifest.num_tokens / secs:>11,.0f}"
                f"{secs:>9.2f}{manifest.num_rows:>7,}"
            )
        a, b = (stores[name] for name, _, _ in runs[:2])
        same = np.array_equal(a.tokens, b.tokens) and np.array_equal(a.mask, b.mask)
        print(f"sentinel-diff and generation-tags stores byte-identical: {same}")

        encoder = ChatEncoder(load_tokenizer(qwen3))
        rows = [p for _, p in ChatSource(chats) if isinstance(p, Conversation)]
        chunks = [rows[i : i + CHUNK] for i in range(0, len(rows), CHUNK)]
        bad = Conversation(
            [
                {"role": "user", "content": "cut \ud83d emoji"},
                {"role": "assistant", "content": "ok"},
            ]
        )
        poisoned = [[*chunk[:-1], bad] for chunk in chunks]
        clean_s = poisoned_s = float("inf")
        for _ in range(3):  # interleaved, best of three each
            clean_s = min(clean_s, timed(lambda: [encoder.encode_batch(c) for c in chunks])[1])
            poisoned_s = min(
                poisoned_s, timed(lambda: [encoder.encode_batch(c) for c in poisoned])[1]
            )
        print(
            f"\nencoder, chunks of {CHUNK}: clean {len(rows) / clean_s:,.0f} rows/s, one "
            f"unencodable row per chunk {len(rows) / poisoned_s:,.0f} rows/s "
            f"(fallback costs {poisoned_s / clean_s:.2f}x the chunk)"
        )


if __name__ == "__main__":
    main()
