"""Token store benchmark: import throughput, synth throughput, open cost, random row access.

Run: .venv/bin/python benchmarks/bench_store.py  (about a minute on 2 cores)

Everything is built locally: a byte-level BPE tokenizer trained on generated words (Qwen-style
chat template, once plain and once with {% generation %} tags) and multi-turn chat JSONL, so the
two mask strategies are timed side by side on the same rows.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np

from trainer.data.chat_import import import_chat_jsonl
from trainer.data.store import TokenStore
from trainer.data.synth import synth_store

CHAT_ROWS = 2_000
SYNTH_ROWS = 20_000
ACCESS_READS = 200_000
BATCHES = 2_000

PLAIN = (
    r"{%- for m in messages -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
TAGGED = (
    r"{%- for m in messages -%}"
    r"{%- if m['role'] == 'assistant' -%}"
    r"{{ '<|im_start|>assistant\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    r"{% endgeneration %}{{ '\n' }}"
    r"{%- else -%}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endif -%}{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)
TEMPLATES = (("sentinel-diff", PLAIN), ("generation-tags", TAGGED))


def words(rng: np.random.Generator, n: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    return ["".join(rng.choice(letters, size=rng.integers(2, 9))) for _ in range(n)]


def build_tokenizer(directory: Path, template: str, corpus: list[str]) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=4000,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(corpus, trainer)
    # transformers leaves the fast tokenizer's __init__ unannotated.
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    return directory


def write_chats(path: Path, rng: np.random.Generator, vocab: list[str]) -> None:
    """Multi-turn chats of a few hundred tokens, 2-4 exchanges each."""
    with path.open("w") as fh:
        for _ in range(CHAT_ROWS):
            turns = []
            for _ in range(int(rng.integers(2, 5))):
                user = " ".join(rng.choice(vocab, size=int(rng.integers(5, 40))))
                reply = " ".join(rng.choice(vocab, size=int(rng.integers(20, 120))))
                turns += [
                    {"role": "user", "content": user},
                    {"role": "assistant", "content": reply},
                ]
            fh.write(json.dumps({"conversations": turns}) + "\n")


R = TypeVar("R")


def timed(fn: Callable[[], R]) -> tuple[R, float]:
    start = time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start


def main() -> None:
    rng = np.random.default_rng(0)
    vocab = words(rng, 3000)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        corpus = [" ".join(rng.choice(vocab, size=50)) for _ in range(2000)]
        chats = tmp / "chats.jsonl"
        write_chats(chats, rng, vocab)
        print(f"# token store benchmark (cpus={os.cpu_count()}, numpy {np.__version__})")
        print(f"\nimport: {CHAT_ROWS:,} multi-turn chats, local BPE (4k vocab), max_length 4096")
        print(f"{'strategy':<22}{'workers':>8}{'rows/s':>10}{'tokens/s':>12}{'seconds':>9}")
        toks = {name: build_tokenizer(tmp / f"tok-{name}", t, corpus) for name, t in TEMPLATES}
        runs = (("sentinel-diff", 1), ("sentinel-diff", 2), ("generation-tags", 1))
        for name, workers in runs:
            out = tmp / f"s-{name}-{workers}"
            manifest, secs = timed(
                functools.partial(import_chat_jsonl, chats, toks[name], 4096, out, workers=workers)
            )
            assert manifest.mask_strategy == name
            print(
                f"{name:<22}{workers:>8}{manifest.num_rows / secs:>10,.0f}"
                f"{manifest.num_tokens / secs:>12,.0f}{secs:>9.2f}"
            )
        a = TokenStore.open(tmp / "s-sentinel-diff-1")
        b = TokenStore.open(tmp / "s-generation-tags-1")
        c = TokenStore.open(tmp / "s-sentinel-diff-2")
        same = np.array_equal(a.tokens, b.tokens) and np.array_equal(a.mask, b.mask)
        same_workers = a.manifest.files == c.manifest.files
        print(
            f"byte-identical stores: across strategies {same}, across worker counts {same_workers}"
        )

        store_dir = tmp / "synth"
        manifest, secs = timed(
            lambda: synth_store(
                store_dir,
                lengths_from="seed-shaped",
                vocab_size=151_936,
                rows=SYNTH_ROWS,
                max_length=3072,
            )
        )
        print(
            f"\nsynth: {manifest.num_rows:,} seed-shaped rows (max_length 3072), "
            f"{manifest.num_tokens:,} tokens in {secs:.2f} s = {manifest.num_tokens / secs / 1e6:.2f} M tokens/s"
        )

        store, open_s = timed(lambda: TokenStore.open(store_dir))
        _, verify_s = timed(lambda: TokenStore.open(store_dir, verify=True))
        size_mb = sum(f.bytes for f in manifest.files.values()) / 1e6
        print(
            f"\nopen ({size_mb:,.0f} MB store): {open_s * 1e3:.1f} ms, with verify=True {verify_s:.2f} s"
        )

        idx = rng.integers(0, len(store), size=ACCESS_READS)

        def read_rows() -> int:
            total = 0
            for i in idx:
                tokens, mask = store.row(int(i))
                total += int(tokens[-1]) + int(mask[0])  # touch the pages
            return total

        _, secs = timed(read_rows)
        print(
            f"random row access: {ACCESS_READS / secs:,.0f} rows/s ({secs / ACCESS_READS * 1e6:.1f} us/row)"
        )
        batches = [rng.integers(0, len(store), size=16) for _ in range(BATCHES)]
        _, secs = timed(lambda: [store.gather(b) for b in batches])
        tokens = sum(int(store.lengths[b].max()) * 16 for b in batches)
        print(
            f"gather 16-row padded batches: {BATCHES / secs:,.0f} batches/s, "
            f"{tokens / secs / 1e6:.1f} M padded tokens/s"
        )


if __name__ == "__main__":
    main()
