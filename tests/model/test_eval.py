"""The eval CLI's input handling: prompt formats and one-line errors naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.model.helpers import make_drafter
from trainer import eval as eval_cli
from trainer.model.export import export_drafter
from trainer.model.target import TargetModel


def test_prompts_accept_id_lists_and_input_ids_objects(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('[1, 2, 3]\n\n{"input_ids": [4, 5]}\n')
    assert eval_cli.load_prompts(path, 512) == [[1, 2, 3], [4, 5]]


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[1, 2\n", "p.jsonl:1: invalid JSON"),
        ("[1]\n[]\n", "p.jsonl:2: expected a non-empty list"),
        ("[1, 600]\n", "p.jsonl:1: token id 600 outside"),
        ('{"text": "hi"}\n', "p.jsonl:1: a text prompt needs --tokenizer"),
        ("\n", "p.jsonl: no prompts"),
    ],
)
def test_bad_prompts_name_file_and_line(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(eval_cli.EvalInputError) as info:
        eval_cli.load_prompts(path, 512)
    assert fragment in str(info.value)


def test_cli_exits_2_with_one_line_on_bad_input(
    target: TargetModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Missing drafter export and malformed prompts: exit 2, a single stderr line."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("not json\n")
    drafter_dir = export_drafter(make_drafter(target), tmp_path / "d")
    base = [
        "--target",
        str(target.model.name_or_path),
        "--device",
        "cpu",
        "--prompts",
        str(prompts),
    ]
    assert eval_cli.main([*base, "--drafter", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a drafter export" in err
    assert eval_cli.main([*base, "--drafter", str(drafter_dir)]) == 2
    assert "p.jsonl:1: invalid JSON" in capsys.readouterr().err


def test_cli_writes_json_results(target: TargetModel, tmp_path: Path) -> None:
    """--json records the summary and per-prompt results, including the greedy check."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[5, 6, 7]\n[8, 9]\n")
    out = tmp_path / "r.json"
    rc = eval_cli.main(
        [
            "--target",
            str(target.model.name_or_path),
            "--drafter",
            str(export_drafter(make_drafter(target), tmp_path / "d")),
            "--prompts",
            str(prompts),
            "--max-new-tokens",
            "6",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    data = json.loads(out.read_text())
    assert rc == 0
    assert data["summary"]["prompts"] == 2 and data["summary"]["matches"] == 2
    assert [p["new_tokens"] for p in data["prompts"]] == [6, 6]
    assert data["summary"]["tau"] >= 1.0


def test_text_prompts_go_through_the_given_tokenizer(tmp_path: Path) -> None:
    """{"text": ...} lines are tokenised with --tokenizer DIR (a local word-level tokenizer)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "tiny": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(
        tmp_path / "tok"
    )
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "hello tiny world"}\n[7]\n')
    assert eval_cli.load_prompts(path, 512, tmp_path / "tok") == [[1, 2, 3], [7]]
