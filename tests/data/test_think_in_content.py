"""`</think>` inside plain assistant content: Qwen3's template (like transformers) makes a think
block of the text before it, trained as reasoning. The import keeps doing that but says so:
the rows are counted in the manifest and the summary shows one."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.data.conftest import write_jsonl
from trainer.data.cli import main
from trainer.data.store import TokenStore

STRAY = "Close the block with </think> and then write the answer after it."


def _chat(answer: str, **extra: str) -> dict[str, object]:
    return {
        "messages": [
            {"role": "user", "content": "How do I end a think block?"},
            {"role": "assistant", "content": answer, **extra},
        ]
    }


ROWS = [
    _chat("Plain answer."),  # 1
    _chat(STRAY),  # 2: counted
    _chat("<think>\nShort.\n</think>\n\nThe inline reasoning form."),  # 3: meant as reasoning
    _chat(STRAY, reasoning_content="Given separately."),  # 4: the template keeps content as is
    {  # 5: a history turn with the stray tag, then a clean last turn
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "see </think> here"},
            {"role": "user", "content": "b"},
            {"role": "assistant", "content": "fine"},
        ]
    },
]


def test_think_close_in_plain_content_is_counted_and_shown(
    tmp_path: Path, qwen3_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", ROWS)
    argv = ["import", "--input", str(source), "--tokenizer", str(qwen3_tokenizer_dir)]
    assert main([*argv, "--max-length", "512", "--out", str(tmp_path / "s"), "--workers", "1"]) == 0
    out = capsys.readouterr().out
    stat = TokenStore.open(tmp_path / "s").manifest.params["think_in_content"]
    assert stat["count"] == 2 and stat["first_lines"] == [2, 5]
    example = f"line 2: message 1: {STRAY!r}"
    assert stat["examples"][0] == example
    assert "think      2 rows have '</think>' inside plain assistant content" in out
    assert "(lines 2, 5)" in out and f"      {example}" in out
    assert "line 5:" not in out  # one example is enough


def test_a_template_that_keeps_the_content_reports_nothing(
    tmp_path: Path, qwen_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny ChatML template renders content verbatim: no think block was made."""
    source = write_jsonl(tmp_path / "c.jsonl", ROWS)
    argv = ["import", "--input", str(source), "--tokenizer", str(qwen_tokenizer_dir)]
    assert main([*argv, "--max-length", "512", "--out", str(tmp_path / "s"), "--workers", "1"]) == 0
    assert TokenStore.open(tmp_path / "s").manifest.params["think_in_content"]["count"] == 0
    assert "think " not in capsys.readouterr().out
