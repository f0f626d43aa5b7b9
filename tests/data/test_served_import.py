"""Importing a regenerated file (`trainer.data.served`): the store is the server's ids, the mode
is checked against --template-kwargs by name, and what the importer cannot use is counted.

The files are written here as trainer.regen writes them, with ids from the real Qwen3 tokenizer
(tests/regen exercises the same path through a real vLLM server).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from trainer.data.chat_import import import_chat_jsonl
from trainer.data.cli import main
from trainer.data.errors import InputError
from trainer.data.served import RegenManifest
from trainer.data.store import TokenStore

MANIFEST = RegenManifest(
    model="m",
    reasoning="disable",
    chat_template_kwargs={"enable_thinking": False},
    temperature=0.0,
    max_tokens=64,
)
IM_END = 151645


@pytest.fixture(scope="module")
def tok(qwen3_tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen3_tokenizer_dir))


def served_row(
    tok: Any, question: str, answer: str, completion: list[int] | None = None
) -> dict[str, Any]:
    """A row as trainer.regen writes it: the prompt rendered as a server would (thinking off)."""
    asked = [{"role": "user", "content": question}]
    prompt = tok.apply_chat_template(
        asked, add_generation_prompt=True, enable_thinking=False, return_dict=True
    )["input_ids"]
    ids = completion if completion is not None else [*tok.encode(answer), IM_END]
    gen = {"prompt_token_ids": list(prompt), "token_ids": ids, "finish_reason": "stop"}
    return {
        "id": question.encode().hex()[:32].ljust(32, "0"),
        "messages": [*asked, {"role": "assistant", "content": answer}],
        "dflash_regen": {
            "source": "in.jsonl:1",
            "generations": [gen],
            "length_capped": False,
            "ended": None,
        },
    }


def write(path: Path, *rows: dict[str, Any], manifest: RegenManifest | None = MANIFEST) -> Path:
    lines = ([manifest.line()] if manifest else []) + [json.dumps(r) for r in rows]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_store_is_the_servers_ids_and_a_differing_rerender_is_counted(
    tmp_path: Path, tok: Any, qwen3_tokenizer_dir: Path
) -> None:
    same = served_row(tok, "hi", "Sure, done.")
    # ids the tokenizer would never produce for this text (its characters one by one), and a
    # content that says something else: the store still holds exactly the server's ids
    spelled = [tok.convert_tokens_to_ids(c) for c in "Sure"] + [IM_END]
    other = served_row(tok, "hello", "not what the ids say", completion=spelled)
    source = write(tmp_path / "regen.jsonl", same, other)
    manifest = import_chat_jsonl(source, qwen3_tokenizer_dir, 512, tmp_path / "s")
    store = TokenStore.open(tmp_path / "s")
    assert len(store) == 2 and manifest.params["served_rows"] == 2
    for r, row in enumerate((same, other)):
        gen = row["dflash_regen"]["generations"][0]
        tokens, mask = store.row(r)
        assert tokens.tolist() == gen["prompt_token_ids"] + gen["token_ids"]
        assert mask.tolist() == [0] * len(gen["prompt_token_ids"]) + [1] * len(gen["token_ids"])
        assert store.source_line(r) == r + 2  # line 1 is the manifest
    differs = manifest.params["served_differs"]
    assert differs["count"] == 1 and differs["first_lines"] == [3]
    assert manifest.params["regen"]["reasoning"] == "disable"
    assert manifest.params["rows_read"] == 2  # the manifest line is not a row


def test_template_kwargs_are_checked_against_the_mode_by_name(
    tmp_path: Path, tok: Any, qwen3_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = write(tmp_path / "regen.jsonl", served_row(tok, "hi", "Sure."))
    argv = ["import", "--input", str(source), "--tokenizer", str(qwen3_tokenizer_dir)]
    argv += ["--max-length", "512", "--workers", "1"]
    assert (
        main(
            [*argv, "--out", str(tmp_path / "a"), "--template-kwargs", '{"enable_thinking": true}']
        )
        == 2
    )
    err = capsys.readouterr().err
    assert (
        "'enable_thinking' is true but the rows were generated with false (--reasoning disable)"
        in err
    )
    assert not (tmp_path / "a").exists()
    # the agreeing value states the mode: taken, although the template reads it only for a
    # generation prompt (a file that is not regenerated still refuses it as inert)
    assert (
        main(
            [*argv, "--out", str(tmp_path / "b"), "--template-kwargs", '{"enable_thinking": false}']
        )
        == 0
    )
    out = capsys.readouterr().out
    assert 'regen      --reasoning disable (chat_template_kwargs {"enable_thinking": false})' in out
    none = write(
        tmp_path / "none.jsonl",
        served_row(tok, "hi", "Sure."),
        manifest=MANIFEST.model_copy(update={"reasoning": "none", "chat_template_kwargs": {}}),
    )
    with pytest.raises(
        InputError, match="'enable_thinking' was not sent when the rows were generated"
    ):
        import_chat_jsonl(
            none,
            qwen3_tokenizer_dir,
            512,
            tmp_path / "c",
            template_kwargs={"enable_thinking": False},
        )


def test_a_second_manifest_made_another_way_is_refused(
    tmp_path: Path, tok: Any, qwen3_tokenizer_dir: Path
) -> None:
    row = served_row(tok, "hi", "Sure.")
    joined = tmp_path / "joined.jsonl"
    other = MANIFEST.model_copy(
        update={"reasoning": "save", "chat_template_kwargs": {"enable_thinking": True}}
    )
    joined.write_text(
        "\n".join([MANIFEST.line(), json.dumps(row), other.line(), json.dumps(row)]) + "\n"
    )
    with pytest.raises(
        InputError,
        match=r"joined.jsonl:3: a second regeneration manifest whose reasoning, chat_template_kwargs differ",
    ):
        import_chat_jsonl(joined, qwen3_tokenizer_dir, 512, tmp_path / "s")
    assert not (tmp_path / "s").exists()
    same = tmp_path / "same.jsonl"
    same.write_text(
        "\n".join([MANIFEST.line(), json.dumps(row), MANIFEST.line(), json.dumps(row)]) + "\n"
    )
    assert import_chat_jsonl(same, qwen3_tokenizer_dir, 512, tmp_path / "t").num_rows == 2


def test_unusable_server_ids_are_skipped_with_their_reason(
    tmp_path: Path, tok: Any, qwen3_tokenizer_dir: Path
) -> None:
    good = served_row(tok, "hi", "Sure.")
    short = served_row(tok, "a", "Sure.")
    short["dflash_regen"]["generations"] = []  # an engine without ids: rendered, not skipped
    twice = served_row(tok, "b", "Sure.")
    twice["dflash_regen"]["generations"] *= 2  # 2 generations for 1 assistant turn
    past = served_row(tok, "c", "Sure.", completion=[10**6, IM_END])
    source = write(tmp_path / "regen.jsonl", good, short, twice, past)
    manifest = import_chat_jsonl(source, qwen3_tokenizer_dir, 512, tmp_path / "s")
    assert manifest.num_rows == 2 and manifest.params["served_rows"] == 1
    assert manifest.skipped["bad_served_ids"].first_lines == [4]
    assert "2 entries for 1 assistant turns" in manifest.skipped["bad_served_ids"].examples[0]
    assert manifest.skipped["served_id_out_of_vocab"].first_lines == [5]
