"""A tiny real Hugging Face tokenizer built locally (no downloads) with Qwen-style templates.

Byte-level BPE trained on a few strings, so any text (including non-ASCII) encodes, wrapped in
`PreTrainedTokenizerFast` and saved with `save_pretrained`, exactly the directory shape
`AutoTokenizer.from_pretrained(..., local_files_only=True)` loads in production.
HF renders templates with trim_blocks, hence the explicit '\\n' literals.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import pytest

# <|im_start|>role\ncontent<|im_end|>\n per message, as Qwen/ChatML.
QWEN_TEMPLATE = (
    r"{%- for m in messages -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

# Same rendering, with the assistant output wrapped in {% generation %} (ModelOpt-style).
GENERATION_TEMPLATE = (
    r"{%- for m in messages -%}"
    r"{%- if m['role'] == 'assistant' -%}"
    r"{{ '<|im_start|>assistant\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    r"{% endgeneration %}{{ '\n' }}"
    r"{%- else -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
    r"{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\n' }}{%- endif -%}"
)

CORPUS = [
    "hello world how are you today",
    "the quick brown fox jumps over the lazy dog",
    "system user assistant think",
    "def add(x, y):\n    return x + y\n",
    "Paris is the capital of France.",
    "numbers 0123456789 and symbols ()[]{}.,;:!?",
]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def build_tokenizer(directory: Path, template: str) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    core.train_from_iterator(CORPUS * 20, trainer)
    # transformers leaves the fast tokenizer's __init__ unannotated.
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = template
    fast.save_pretrained(str(directory))
    return directory


@pytest.fixture(scope="session")
def qwen_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok-qwen"), QWEN_TEMPLATE)


@pytest.fixture(scope="session")
def generation_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tokenizer(tmp_path_factory.mktemp("tok-gen"), GENERATION_TEMPLATE)


def write_jsonl(path: Path, rows: Sequence[object]) -> Path:
    """Rows may be objects (dumped as JSON) or raw bytes (written verbatim, for bad input)."""
    with path.open("wb") as fh:
        for row in rows:
            fh.write(row if isinstance(row, bytes) else json.dumps(row).encode())
            fh.write(b"\n")
    return path
