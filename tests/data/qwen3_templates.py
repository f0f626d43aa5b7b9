"""The real Qwen3 chat template and a copy with `{% generation %}` tags, for the two mask paths.

The tagged copy wraps what the assistant emits (think block, content, tool calls, `<|im_end|>`)
in a generation block, as ModelOpt's patched Qwen3 template does; the rendering is unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ASSISTANT_END = """        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}"""
HEADER = "'<|im_start|>' + message.role + '\\n'"
BRANCHES = "        {%- if loop.index0 > ns.last_query_index %}"
REPLACEMENTS = [
    # the header once, before the branches that each emitted it, then open the generation
    (BRANCHES, "        {{- " + HEADER + " }}{% generation %}\n" + BRANCHES),
    (
        "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content",
        "{{- '<think>\\n' + reasoning_content",
    ),
    ("{{- " + HEADER + " + content }}", "{{- content }}"),
    (
        ASSISTANT_END,
        ASSISTANT_END.replace(
            "{{- '<|im_end|>\\n' }}", "{{- '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}"
        ),
    ),
]


def qwen3_template(tokenizer_dir: Path) -> str:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    return str(config["chat_template"])


def tagged_qwen3_template(tokenizer_dir: Path) -> str:
    template = qwen3_template(tokenizer_dir)
    for old, new in REPLACEMENTS:
        assert old in template, old
        template = template.replace(old, new)
    return template


def tagged_qwen3_dir(tokenizer_dir: Path, dest: Path) -> Path:
    """A copy of the tokenizer directory whose template carries generation tags."""
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(tokenizer_dir / "tokenizer.json", dest / "tokenizer.json")
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = tagged_qwen3_template(tokenizer_dir)
    (dest / "tokenizer_config.json").write_text(json.dumps(config))
    return dest
