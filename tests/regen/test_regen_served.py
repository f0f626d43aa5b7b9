"""`python -m trainer.regen` through vLLM's real server (the scripted target: it thinks, calls
a tool and stops), on a small mixed file: ShareGPT multi-turn, OpenAI with tools, a row with
reasoning, a malformed line. Then `trainer.data import` builds the store from the server's ids.

- every assistant turn is the server's own greedy continuation of exactly the prompt it was
  asked (checked on /v1/completions from the stored prompt ids), and a later turn's prompt
  holds the target's earlier answer, never the source's;
- the store's tokens and masks are the server's prompt and completion ids, one row per
  generation;
- the row's tools reached the request (the prompt renders them; the target called the tool)
  and the source's tool result was spliced back after the call;
- the think rule per --reasoning mode, and a reply that still thinks with --reasoning disable
  (a chat template that ignores enable_thinking) is refused into the errors file;
- the import refuses --template-kwargs contradicting the mode by name.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.regen.helpers import (
    TOOL_RESULT,
    read_jsonl,
    rows_of,
    run_import,
    run_regen,
    write_mixed,
)
from tests.serving.engine import QWEN3_EOS
from tests.serving.scripted_target import (
    ANSWER_TEXT,
    REASONING_TEXT,
    THINK_CLOSE,
    THINK_OPEN,
    TOOL_CALL_OPEN,
)
from trainer.data.store import TokenStore
from trainer.serving.client import EngineClient
from trainer.serving.launch import RunningEngine

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]
MAX_TOKENS = 64
EMPTY_THINK = [THINK_OPEN, 271, THINK_CLOSE, 271]  # <think>\n\n</think>\n\n


def decode(tokenizer_dir: Path, ids: list[int]) -> str:
    from tokenizers import Tokenizer

    return str(
        Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).decode(
            ids, skip_special_tokens=False
        )
    )


def by_source(rows: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Rows by their source line."""
    return {int(r["dflash_regen"]["source"].rsplit(":", 1)[1]): r for r in rows}


@pytest.mark.parametrize("mode", ["save", "disable", "none"])
def test_regenerated_turns_are_the_servers_own_and_import_as_its_ids(
    mode: str, regen_server: RunningEngine, tmp_path: Path, qwen3_tokenizer_dir: Path
) -> None:
    source = write_mixed(tmp_path / "mixed.jsonl")
    out = tmp_path / "regen.jsonl"
    done = run_regen(
        [source], regen_server.url, out, "--reasoning", mode, "--max-tokens", str(MAX_TOKENS)
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        "1 input rows skipped: malformed_json 1 (lines 4" in done.stdout
    )  # the importer's accounting
    assert read_jsonl(tmp_path / "regen.errors.jsonl") == []
    manifest, rows = rows_of(out)
    assert manifest["reasoning"] == mode
    assert (
        manifest["chat_template_kwargs"]
        == {"save": {"enable_thinking": True}, "disable": {"enable_thinking": False}, "none": {}}[
            mode
        ]
    )
    lines = by_source(rows)
    assert sorted(lines) == [1, 2, 3]

    # every generation is the engine's own greedy continuation of exactly its prompt
    with EngineClient(regen_server.url) as engine:
        for row in rows:
            for gen in row["dflash_regen"]["generations"]:
                again = engine.complete(
                    gen["prompt_token_ids"], max_tokens=MAX_TOKENS, stop_ids=QWEN3_EOS
                )
                assert again == gen["token_ids"], row["dflash_regen"]["source"]

    # multi-turn: turn 2 was asked on the target's own turn 1, not the source's
    sharegpt = lines[1]
    gens = sharegpt["dflash_regen"]["generations"]
    assert len(gens) == 2
    second_prompt = decode(qwen3_tokenizer_dir, gens[1]["prompt_token_ids"])
    assert ANSWER_TEXT in second_prompt and "How can I help" not in second_prompt
    assert [m["role"] for m in sharegpt["messages"]] == ["user", "assistant", "user", "assistant"]

    # tools: rendered into the request, called by the target, the source's result spliced back
    tools_row = lines[2]
    first, second = tools_row["dflash_regen"]["generations"]
    assert '"name": "get_weather"' in decode(qwen3_tokenizer_dir, first["prompt_token_ids"])
    assert TOOL_CALL_OPEN in first["token_ids"] and first["finish_reason"] == "tool_calls"
    roles = [m["role"] for m in tools_row["messages"]]
    assert roles == ["system", "user", "assistant", "tool", "assistant"]
    call = tools_row["messages"][2]["tool_calls"][0]
    assert call["function"]["name"] == "get_weather" and call["id"] == "call00001"
    assert tools_row["messages"][3] == {
        "role": "tool",
        "content": TOOL_RESULT,
        "tool_call_id": "call00001",
    }
    assert f"<tool_response>\n{TOOL_RESULT}\n</tool_response>" in decode(
        qwen3_tokenizer_dir, second["prompt_token_ids"]
    )
    assert tools_row["tools"][0]["function"]["name"] == "get_weather"

    # the think rule of the mode
    assistants = [m for r in rows for m in r["messages"] if m["role"] == "assistant"]
    for m in assistants:
        assert "<think>" not in m["content"] and "</think>" not in m["content"]
    all_gens = [g for r in rows for g in r["dflash_regen"]["generations"]]
    if mode == "disable":
        assert all("reasoning_content" not in m for m in assistants)
        assert all(g["prompt_token_ids"][-4:] == EMPTY_THINK for g in all_gens)
        assert all(g["token_ids"][0] != THINK_OPEN for g in all_gens)
    else:  # save, and none (the server's default: thinking on)
        assert all(m["reasoning_content"] == REASONING_TEXT for m in assistants)
        assert all(g["token_ids"][0] == THINK_OPEN for g in all_gens)

    # the import: one store row per generation, exactly the server's ids and masks
    store_dir = tmp_path / "store"
    imported = run_import(out, qwen3_tokenizer_dir, store_dir)
    assert imported.returncode == 0, imported.stderr
    store = TokenStore.open(store_dir)
    file_lines = {
        json.loads(text).get("id"): n for n, text in enumerate(out.read_text().splitlines(), 1)
    }
    order = sorted(
        (
            (file_lines[r["id"]], k, g)
            for r in rows
            for k, g in enumerate(r["dflash_regen"]["generations"])
        ),
        key=lambda t: (t[0], t[1]),
    )
    assert len(store) == len(order) == 5
    for r, (line, _, gen) in enumerate(order):
        tokens, mask = store.row(r)
        assert store.source_line(r) == line
        assert tokens.tolist() == gen["prompt_token_ids"] + gen["token_ids"]
        want = np.r_[np.zeros(len(gen["prompt_token_ids"])), np.ones(len(gen["token_ids"]))]
        assert mask.tolist() == want.astype(int).tolist()
    assert f"served     {len(order)} rows from the server's token ids" in imported.stdout

    # the mode is checked by name against the import's --template-kwargs
    wrong = {"save": False, "disable": True, "none": False}[mode]
    refused = run_import(
        out,
        qwen3_tokenizer_dir,
        tmp_path / "refused",
        "--template-kwargs",
        json.dumps({"enable_thinking": wrong}),
    )
    assert refused.returncode == 2
    assert "--template-kwargs" in refused.stderr and "'enable_thinking'" in refused.stderr
    assert not (tmp_path / "refused").exists()
    if mode != "none":
        agreed = run_import(
            out,
            qwen3_tokenizer_dir,
            tmp_path / "agreed",
            "--template-kwargs",
            json.dumps({"enable_thinking": not wrong}),
        )
        assert agreed.returncode == 0, agreed.stderr


def test_a_reply_that_still_thinks_with_thinking_off_goes_to_the_errors_file(
    regen_server: RunningEngine, tmp_path: Path, qwen3_tokenizer_dir: Path
) -> None:
    """A chat template that ignores enable_thinking (the real failure: the server thinks
    whatever the request asks) makes every reply think: --reasoning disable refuses them all,
    each row in the errors file with the guard's reason, none in OUT."""
    template = json.loads((qwen3_tokenizer_dir / "tokenizer_config.json").read_text())[
        "chat_template"
    ]
    deaf = template.replace("enable_thinking is defined and enable_thinking is false", "false")
    assert deaf != template
    source = write_mixed(tmp_path / "mixed.jsonl")
    out = tmp_path / "regen.jsonl"
    sampling = json.dumps({"chat_template": deaf})
    done = run_regen(
        [source], regen_server.url, out, "--reasoning", "disable", "--sampling", sampling,
        "--max-tokens", str(MAX_TOKENS),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    _, rows = rows_of(out)
    assert rows == []
    errors = read_jsonl(tmp_path / "regen.errors.jsonl")
    assert len(errors) == 3
    assert {e["reason"] for e in errors} == {"think_guard"}
    assert all("'<think>'" in e["detail"] and "--reasoning disable" in e["detail"] for e in errors)


def test_a_reply_cut_at_max_tokens_is_kept_marked_or_dropped_and_limit_takes_the_first_rows(
    regen_server: RunningEngine, tmp_path: Path
) -> None:
    source = write_mixed(tmp_path / "mixed.jsonl")
    kept = tmp_path / "kept.jsonl"
    done = run_regen([source], regen_server.url, kept, "--max-tokens", "3", "--limit", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    _, rows = rows_of(kept)
    assert sorted(r["dflash_regen"]["source"].rsplit(":", 1)[1] for r in rows) == ["1", "2"]
    for row in rows:  # the conversation ends at the cut reply, marked
        meta = row["dflash_regen"]
        assert meta["length_capped"] and meta["ended"] == "length"
        assert [g["finish_reason"] for g in meta["generations"]] == ["length"]
        assert len(meta["generations"][0]["token_ids"]) == 3
        assert sum(m["role"] == "assistant" for m in row["messages"]) == 1
    assert "length=2 " in done.stdout and "2 length-capped (kept, marked)" in done.stdout

    dropped = tmp_path / "dropped.jsonl"
    done = run_regen(
        [source], regen_server.url, dropped, "--max-tokens", "3", "--on-length", "drop"
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert rows_of(dropped)[1] == []
    errors = read_jsonl(tmp_path / "dropped.errors.jsonl")
    assert len(errors) == 3 and {e["reason"] for e in errors} == {"length_capped"}
    assert "3 length-capped (dropped)" in done.stdout
