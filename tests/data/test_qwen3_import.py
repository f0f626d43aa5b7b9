"""The import against the real Qwen3 tokenizer and template, on hand-built real-format files.

Masks are checked by decoding the supervised tokens: exactly the assistant replies (with their
think block when the template renders one) and their closing `<|im_end|>`; never a role
header, user, system or tool text.
"""

from __future__ import annotations

import hashlib
import json
import unicodedata
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.data.conftest import write_jsonl
from tests.data.qwen3_templates import tagged_qwen3_dir
from trainer.data.chat_import import import_chat_jsonl, load_tokenizer
from trainer.data.chat_mask import (
    GENERATION_TAGS,
    SENTINEL_DIFF,
    TOKENIZER_ERROR,
    ChatEncoder,
    Encoded,
)
from trainer.data.cli import main
from trainer.data.conversations import Conversation, Message, Rejected, normalise_conversation
from trainer.data.sources import ChatSource
from trainer.data.store import LINES, MANIFEST, TokenStore

FIXTURES = Path(__file__).resolve().parent / "fixtures"
MIXED = FIXTURES / "sharegpt_mixed.jsonl"
OPENAI = FIXTURES / "openai_tools_reasoning.jsonl"
ARRAY = FIXTURES / "glaive_array.json"
END = "<|im_end|>"


@pytest.fixture(scope="module")
def tagged_dir(qwen3_tokenizer_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tagged_qwen3_dir(qwen3_tokenizer_dir, tmp_path_factory.mktemp("qwen3-tagged"))


@pytest.fixture(scope="module")
def qwen3(qwen3_tokenizer_dir: Path) -> Any:
    return load_tokenizer(qwen3_tokenizer_dir)


def _inline_thought(content: str) -> str:
    return content.split("</think>")[0].split("<think>")[-1]


def nfc(text: str) -> str:
    return unicodedata.normalize("NFC", text)


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def supervised(tokenizer: Any, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
    return [tokenizer.decode(tokens[a:b].tolist()) for a, b in _runs(mask)]


def _import(source: Path, tok_dir: Path, out: Path, **kw: Any) -> TokenStore:
    import_chat_jsonl(source, tok_dir, 4096, out, **kw)
    return TokenStore.open(out, verify=True)


def _rows(path: Path) -> dict[int, Conversation]:
    return {line: p for line, p in ChatSource(path) if isinstance(p, Conversation)}


def test_mixed_real_formats_import_and_every_bad_row_is_named(
    tmp_path: Path, qwen3_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    argv = ["import", "--input", str(MIXED), "--tokenizer", str(qwen3_tokenizer_dir)]
    assert main([*argv, "--max-length", "4096", "--out", str(out), "--workers", "1"]) == 0
    printed = capsys.readouterr().out
    store = TokenStore.open(out, verify=True)
    kept = [1, 2, 3, 5, 6, 10, 11, 12]  # bing, bard, chatgpt, glaive, LMSYS, parts, NUL/RTL
    assert [store.source_line(i) for i in range(len(store))] == kept
    skipped = {r: (s.first_lines, s.examples) for r, s in store.manifest.skipped.items()}
    assert skipped == {
        "invalid_unicode": (
            [4],
            ["line 4: message 0 content has a lone surrogate '\\ud83d' at character 15"],
        ),
        "unknown_role": ([7], ["line 7: role 'narrator'"]),
        "bad_schema": (
            [8],
            [
                "line 8: no 'conversations', 'messages' or 'conversation' key, keys were "
                "['instruction', 'input', 'output']"
            ],
        ),
        "malformed_json": ([9], ["line 9: Unterminated string starting at column 61"]),
    }
    for _, examples in skipped.values():
        for example in examples:
            assert example in printed
    assert "at at" not in printed
    # the same with worker processes (conversations with tools cross the process boundary)
    two = tmp_path / "two"
    assert main([*argv, "--max-length", "4096", "--out", str(two), "--workers", "2"]) == 0
    assert TokenStore.open(two).manifest.files == store.manifest.files


def test_unknown_roles_list_their_distinct_values(
    tmp_path: Path, qwen3_tokenizer_dir: Path
) -> None:
    good = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
    rows: list[object] = [good]
    for role in ["narrator", "critic", "narrator", "judge", "critic"]:
        rows.append({"conversations": [{"from": role, "value": "x"}, good["conversations"][1]]})
    source = write_jsonl(tmp_path / "c.jsonl", rows)
    manifest = import_chat_jsonl(source, qwen3_tokenizer_dir, 256, tmp_path / "s")
    stat = manifest.skipped["unknown_role"]
    assert stat.count == 5 and stat.first_lines == [2, 3, 4, 5, 6]
    assert stat.examples == [
        "line 2: role 'narrator'",
        "line 3: role 'critic'",
        "line 5: role 'judge'",
    ]


@pytest.mark.parametrize("path", [MIXED, OPENAI, ARRAY], ids=lambda p: p.name)
def test_supervised_text_is_exactly_the_assistant_output(
    tmp_path: Path, qwen3_tokenizer_dir: Path, qwen3: Any, path: Path
) -> None:
    store = _import(path, qwen3_tokenizer_dir, tmp_path / "s")
    rows = _rows(path)
    for i in range(len(store)):
        row = rows[store.source_line(i) or 0]
        tokens, mask = store.row(i)
        # the row is the template's own rendering with the row's tools (Qwen3 normalises NFC)
        assert qwen3.decode(tokens.tolist()) == nfc(
            qwen3.apply_chat_template(row.messages, tools=row.tools, tokenize=False)
        )
        runs = supervised(qwen3, tokens, mask)
        assistants = [m for m in row.messages if m["role"] == "assistant"]
        assert len(runs) == len(assistants)
        for run, message in zip(runs, assistants, strict=True):
            assert run.endswith(END) and run.count(END) == 1
            assert "<|im_start|>" not in run and "user\n" not in run
            answer = nfc(message["content"].split("</think>")[-1].lstrip("\n"))
            think = ""
            if run.startswith("<think>"):  # Qwen3 renders reasoning on the last turn only
                assert message is assistants[-1]
                thought = message.get("reasoning_content") or _inline_thought(message["content"])
                think = f"<think>\n{nfc(thought).strip()}\n</think>\n\n"
            if message.get("tool_calls"):
                call = message["tool_calls"][0]["function"]
                assert run.startswith(think + answer) and run.endswith("</tool_call>" + END)
                assert f'<tool_call>\n{{"name": "{call["name"]}"' in run
            else:
                assert run == think + answer + END
        text = "".join(runs)
        for message in row.messages:
            if message["role"] in ("user", "system", "tool") and len(message["content"]) > 8:
                assert nfc(message["content"]) not in text, message
        assert "# Tools" not in text and "<tools>" not in text and "<tool_response>" not in text


def test_hand_checked_rows(tmp_path: Path, qwen3_tokenizer_dir: Path, qwen3: Any) -> None:
    mixed = _import(MIXED, qwen3_tokenizer_dir, tmp_path / "m")
    openai = _import(OPENAI, qwen3_tokenizer_dir, tmp_path / "o")
    assert supervised(qwen3, *mixed.row(2)) == ["Tokyo." + END, "Rome." + END]  # bard, chatgpt
    assert supervised(qwen3, *mixed.row(6)) == ["Four." + END]  # value/text content parts
    assert supervised(qwen3, *openai.row(1)) == [
        "144." + END,  # history turn: Qwen3 drops its reasoning
        "<think>\nThirteen squared is 169.\n</think>\n\n169." + END,
    ]
    assert supervised(qwen3, *openai.row(2)) == [
        "No, 91 = 7 x 13." + END,
        "<think>\nNo divisor up to 9 works.\n</think>\n\nYes, 97 is prime." + END,
    ]
    # no reasoning: the empty think block Qwen3 renders is boilerplate, not supervised
    tokens, mask = openai.row(3)
    assert "<think>\n\n</think>\n\n" in qwen3.decode(tokens.tolist())
    assert supervised(qwen3, tokens, mask) == ["Blue." + END]
    assert openai.manifest.params["reasoning_turns"] == 4
    assert openai.manifest.params["reasoning_dropped"] == 2


def test_row_tools_reach_the_template_and_stay_unsupervised(
    tmp_path: Path, qwen3_tokenizer_dir: Path, qwen3: Any
) -> None:
    store = _import(ARRAY, qwen3_tokenizer_dir, tmp_path / "s")
    assert [store.source_line(i) for i in range(len(store))] == [2, 11, 24]
    tokens, mask = store.row(0)
    text = qwen3.decode(tokens.tolist())
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert '<tools>\n{"type": "function", "function": {"name": "convert_currency"' in text
    head = text.index("<|im_start|>user")
    assert not mask[: len(qwen3(text[:head], add_special_tokens=False)["input_ids"])].any()
    assert supervised(qwen3, tokens, mask) == [
        '<tool_call>\n{"name": "convert_currency", "arguments": {"amount": 100, "from": "USD", '
        '"to": "EUR"}}\n</tool_call>' + END,
        "100 USD is about 92.50 EUR." + END,
    ]
    without = tokens.size - len(
        qwen3.apply_chat_template(_rows(ARRAY)[2].messages, return_dict=True)["input_ids"]
    )
    assert without > 100  # the tools block is in the context the drafter trains on
    assert "# Tools" not in qwen3.decode(store.row(1)[0].tolist())  # "tools": "[]"


@pytest.mark.parametrize("path", [MIXED, OPENAI, ARRAY], ids=lambda p: p.name)
@pytest.mark.parametrize("per_turn", [False, True], ids=["rows", "per-turn"])
def test_both_mask_paths_agree_on_the_real_template(
    tmp_path: Path, qwen3_tokenizer_dir: Path, tagged_dir: Path, path: Path, per_turn: bool
) -> None:
    plain = import_chat_jsonl(path, qwen3_tokenizer_dir, 4096, tmp_path / "a", per_turn=per_turn)
    tagged = import_chat_jsonl(path, tagged_dir, 4096, tmp_path / "b", per_turn=per_turn)
    assert (plain.mask_strategy, tagged.mask_strategy) == (SENTINEL_DIFF, GENERATION_TAGS)
    assert {k: v.sha256 for k, v in plain.files.items()} == {
        k: v.sha256 for k, v in tagged.files.items()
    }


def test_generation_tags_match_transformers_but_for_the_empty_think_block(
    tagged_dir: Path,
) -> None:
    tokenizer = load_tokenizer(tagged_dir)
    encoder = ChatEncoder(tokenizer)
    think = set(tokenizer("<think>\n\n</think>\n\n", add_special_tokens=False)["input_ids"])
    for path in (MIXED, OPENAI, ARRAY):
        rows = list(_rows(path).values())
        for row, ours in zip(rows, encoder.encode_batch(rows), strict=True):
            assert isinstance(ours, Encoded)
            theirs = tokenizer.apply_chat_template(
                row.messages,
                tools=row.tools,
                return_dict=True,
                return_assistant_tokens_mask=True,
            )
            assert ours.tokens.tolist() == theirs["input_ids"]
            diff = np.flatnonzero(ours.mask != np.asarray(theirs["assistant_masks"]))
            assert all(ours.mask[d] == 0 and int(ours.tokens[d]) in think for d in diff)


def test_per_turn_expansion_trains_every_turns_reasoning(
    tmp_path: Path, qwen3_tokenizer_dir: Path, qwen3: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    argv = ["import", "--input", str(OPENAI), "--tokenizer", str(qwen3_tokenizer_dir)]
    assert main([*argv, "--max-length", "4096", "--out", str(out), "--per-turn"]) == 0
    assert "--per-turn added 3 rows" in capsys.readouterr().out
    store = TokenStore.open(out)
    assert [store.source_line(i) for i in range(len(store))] == [1, 1, 2, 2, 3, 3, 4]
    assert supervised(qwen3, *store.row(2)) == [
        "<think>\nTwelve twelves are 144.\n</think>\n\n144." + END
    ]
    assert supervised(qwen3, *store.row(3)) == [
        "<think>\nThirteen squared is 169.\n</think>\n\n169." + END
    ]
    assert supervised(qwen3, *store.row(4)) == [
        "<think>\n91 = 7 * 13.\n</think>\n\nNo, 91 = 7 x 13." + END
    ]
    assert store.manifest.params["reasoning_dropped"] == 0
    assert store.manifest.params["reasoning_turns"] == 4
    # the tool-call turn and the answer after the tool result are separate rows
    assert len(supervised(qwen3, *store.row(0))) == len(supervised(qwen3, *store.row(1))) == 1


def test_template_kwargs_that_cannot_change_the_store_are_refused(
    tmp_path: Path, qwen3_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["import", "--input", str(OPENAI), "--tokenizer", str(qwen3_tokenizer_dir)]
    argv += ["--max-length", "512", "--out", str(tmp_path / "s")]
    assert main([*argv, "--template-kwargs", '{"enable_thinking": false, "thinkng": 1}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "'enable_thinking' is read only under add_generation_prompt" in err
    assert "'thinkng' is never read by the chat template" in err
    assert not (tmp_path / "s").exists()


def test_template_kwargs_reach_every_render(tmp_path: Path, qwen3_tokenizer_dir: Path) -> None:
    # Qwen3's template with a kwarg read in the body: the store must follow it on both paths
    template = (qwen3_tokenizer_dir / "tokenizer_config.json").read_text()
    config = json.loads(template)
    marker = "{%- for message in messages %}\n    {%- if message.content is string %}"
    assert marker in config["chat_template"]
    custom = config["chat_template"].replace(
        marker,
        "{{- '<|im_start|>system\\n' + persona + '<|im_end|>\\n' if persona is defined }}" + marker,
    )
    path = tmp_path / "persona.jinja"
    path.write_text(custom)
    a = import_chat_jsonl(OPENAI, qwen3_tokenizer_dir, 4096, tmp_path / "a", chat_template=path)
    b = import_chat_jsonl(
        OPENAI,
        qwen3_tokenizer_dir,
        4096,
        tmp_path / "b",
        template_kwargs={"persona": "terse"},
        chat_template=path,
    )
    assert a.files[LINES].sha256 == b.files[LINES].sha256
    assert a.files["tokens.i32"].sha256 != b.files["tokens.i32"].sha256
    tokenizer = load_tokenizer(qwen3_tokenizer_dir, path)
    store = TokenStore.open(tmp_path / "b")
    rows = _rows(OPENAI)
    for i in range(len(store)):
        row = rows[store.source_line(i) or 0]
        own = tokenizer.apply_chat_template(
            row.messages, tools=row.tools, tokenize=False, persona="terse"
        )
        assert tokenizer.decode(store.row(i)[0].tolist()) == own
        assert "<|im_start|>system\nterse<|im_end|>" in own


def test_a_json_array_file_is_read_as_rows_with_their_lines(
    tmp_path: Path, qwen3_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rows = [json.loads(line) for line in MIXED.read_text().splitlines()[:3]]
    compact = tmp_path / "compact.json"
    compact.write_text(json.dumps(rows))  # one line
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(rows, indent=2))
    truncated = tmp_path / "truncated.json"
    truncated.write_text(pretty.read_text()[: pretty.read_text().rindex("{")])
    stores = {}
    for path in (compact, pretty, truncated):
        stores[path.name] = import_chat_jsonl(
            path, qwen3_tokenizer_dir, 512, tmp_path / f"s-{path.name}"
        )
    assert stores["compact.json"].num_rows == stores["pretty.json"].num_rows == 3
    assert stores["compact.json"].files["tokens.i32"] == stores["pretty.json"].files["tokens.i32"]
    assert stores["pretty.json"].params["source_format"] == "json-array"
    starts = [i + 1 for i, line in enumerate(pretty.read_text().splitlines()) if line == "  {"]
    got = TokenStore.open(tmp_path / "s-pretty.json")
    assert [got.source_line(i) for i in range(3)] == starts
    # a cut-off array keeps the rows before the cut and names the line it broke on
    cut = stores["truncated.json"]
    assert cut.num_rows == 2
    assert cut.skipped["malformed_json"].first_lines == [starts[2]]
    assert "unreadable from here" in cut.skipped["malformed_json"].examples[0]
    assert cut.source_sha256 == hashlib.sha256(truncated.read_bytes()).hexdigest()
    # a break mid-file: same rows kept, and the rest of the file is still hashed
    text = pretty.read_text()
    broken = tmp_path / "broken.json"
    broken.write_text(text[: text.rindex("{")] + "{oops" + text[text.rindex("{") + 1 :])
    mid = ChatSource(broken)
    assert [line for line, p in mid if isinstance(p, Conversation)] == starts[:2]
    assert mid.file_sha256() == hashlib.sha256(broken.read_bytes()).hexdigest()
    assert stores["pretty.json"].source_sha256 == hashlib.sha256(pretty.read_bytes()).hexdigest()
    assert main(["show", str(tmp_path / "s-pretty.json"), "--rows", "1"]) == 0
    assert f"--- row 1 (input line {starts[1]}):" in capsys.readouterr().out


def test_array_rows_spanning_read_chunks(qwen3_tokenizer_dir: Path) -> None:
    small = ChatSource(ARRAY, chunk_chars=7)
    big = ChatSource(ARRAY)
    assert [(line, p) for line, p in small] == [(line, p) for line, p in big]
    assert small.file_sha256() == big.file_sha256()


def test_jsonl_whose_first_line_is_a_broken_array_stays_jsonl(
    tmp_path: Path, qwen3_tokenizer_dir: Path
) -> None:
    good = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    source = write_jsonl(tmp_path / "c.jsonl", [b"[1, 2", good, [1, 2, 3], good])
    manifest = import_chat_jsonl(source, qwen3_tokenizer_dir, 64, tmp_path / "s")
    assert manifest.num_rows == 2 and manifest.params["source_format"] == "jsonl"
    assert manifest.skipped["malformed_json"].first_lines == [1]
    assert manifest.skipped["bad_schema"].first_lines == [3]


def _surrogate_row() -> Conversation:
    return Conversation(
        [
            {"role": "user", "content": "Here: \ud83d and more"},
            {"role": "assistant", "content": "ok"},
        ]
    )


@pytest.mark.parametrize("tagged", [False, True], ids=["sentinel-diff", "generation-tags"])
def test_a_row_the_tokenizer_cannot_encode_is_rejected_alone(
    qwen3_tokenizer_dir: Path, tagged_dir: Path, tagged: bool
) -> None:
    # bypasses the parser's own surrogate check: the encoder must isolate the row by itself
    encoder = ChatEncoder(load_tokenizer(tagged_dir if tagged else qwen3_tokenizer_dir))
    good = normalise_conversation(json.loads(MIXED.read_text().splitlines()[0]))
    assert isinstance(good, Conversation)
    results = encoder.encode_batch([good, _surrogate_row(), good])
    assert isinstance(results[0], Encoded) and isinstance(results[2], Encoded)
    assert results[0].tokens.tolist() == results[2].tokens.tolist()
    assert isinstance(results[1], Rejected) and results[1].reason == TOKENIZER_ERROR


TEXT = st.text(
    st.characters(
        codec=None,
        categories=("L", "M", "N", "P", "S", "Z", "Cc", "Cf", "Cs", "Co"),
        include_characters="\x00\u0301\u05d0\u200f\u202e\ud83d\udca9",
    ),
    max_size=12,
)


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    turns=st.lists(st.tuples(TEXT, TEXT), min_size=1, max_size=3),
    reasoning=st.one_of(st.none(), TEXT),
    last_only=st.booleans(),
)
def test_arbitrary_unicode_never_breaks_an_import_on_either_path(
    qwen3_tokenizer_dir: Path,
    tagged_dir: Path,
    turns: list[tuple[str, str]],
    reasoning: str | None,
    last_only: bool,
) -> None:
    messages: list[Message] = []
    for user, reply in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    if reasoning:
        messages[-1]["reasoning_content"] = reasoning
    row = Conversation(messages, last_turn_only=last_only)  # last_only: a --per-turn row
    results = []
    for directory in (qwen3_tokenizer_dir, tagged_dir):
        encoder = _encoder(directory)
        result = encoder.encode_batch([row, _surrogate_row()])
        assert isinstance(result[1], Rejected)
        results.append(result[0])
        if isinstance(result[0], Rejected):
            continue
        tokens, mask = result[0].tokens, result[0].mask
        tokenizer = encoder.tokenizer
        assert (
            tokens.tolist() == tokenizer(encoder.render(row), add_special_tokens=False)["input_ids"]
        )
        start, end = tokenizer.convert_tokens_to_ids(["<|im_start|>", END])
        assert not mask[tokens == start].any()  # never a header
        trained = 1 if last_only else len(turns)
        assert int(mask[tokens == end].sum()) == trained  # every trained turn's end, once
    if all(isinstance(r, Encoded) for r in results):
        a, b = results
        assert isinstance(a, Encoded) and isinstance(b, Encoded)
        assert a.tokens.tolist() == b.tokens.tolist() and a.mask.tolist() == b.mask.tolist()
    else:  # a row is a row: both paths reject it
        assert all(isinstance(r, Rejected) for r in results)


_ENCODERS: dict[Path, ChatEncoder] = {}


def _encoder(directory: Path) -> ChatEncoder:
    if directory not in _ENCODERS:
        _ENCODERS[directory] = ChatEncoder(load_tokenizer(directory))
    return _ENCODERS[directory]


def test_old_stores_without_source_lines_still_open(
    tmp_path: Path, qwen3_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    import_chat_jsonl(OPENAI, qwen3_tokenizer_dir, 512, out)
    # what a store written before lines.i64 and skip examples existed looks like
    (out / LINES).unlink()
    manifest = json.loads((out / MANIFEST).read_text())
    del manifest["files"][LINES]
    for stat in manifest["skipped"].values():
        stat.pop("examples", None)
    (out / MANIFEST).write_text(json.dumps(manifest))
    store = TokenStore.open(out, verify=True)
    assert store.lines is None and store.source_line(0) is None
    assert main(["show", str(out), "--rows", "0"]) == 0
    assert "--- row 0: " in capsys.readouterr().out


@pytest.mark.parametrize("tagged", [False, True], ids=["sentinel-diff", "generation-tags"])
def test_a_malformed_row_from_any_caller_is_rejected_alone(
    qwen3_tokenizer_dir: Path, tagged_dir: Path, tagged: bool
) -> None:
    encoder = _encoder(tagged_dir if tagged else qwen3_tokenizer_dir)
    good = normalise_conversation(json.loads(MIXED.read_text().splitlines()[1]))
    assert isinstance(good, Conversation)
    odd = Conversation(
        json.loads('[{"role": "user", "content": 5}, {"role": "assistant", "content": "x"}]')
    )
    results = encoder.encode_batch([good, odd, good])
    assert [type(r).__name__ for r in results] == ["Encoded", "Rejected", "Encoded"]


def test_array_and_jsonl_edges_around_the_first_line(
    tmp_path: Path, qwen3_tokenizer_dir: Path
) -> None:
    row = json.loads(MIXED.read_text().splitlines()[0])
    long_row = dict(row, padding="x" * 100_000)  # first line past the format probe
    one_line = tmp_path / "one-line.json"
    one_line.write_text(json.dumps([long_row, row, row]))
    got = [(line, type(p).__name__) for line, p in ChatSource(one_line)]
    assert got == [(1, "Conversation")] * 3
    jsonl = write_jsonl(tmp_path / "long.jsonl", [long_row, row])
    assert [(line, type(p).__name__) for line, p in ChatSource(jsonl)] == [
        (1, "Conversation"),
        (2, "Conversation"),
    ]
    # a JSONL file whose first row is an array of objects: read as an array, and the rows
    # after its ']' are reported, not silently dropped
    odd = write_jsonl(tmp_path / "odd.jsonl", [[row], row, row])
    source = ChatSource(odd)
    parsed = list(source)
    assert [line for line, _ in parsed] == [1, 2]
    assert isinstance(parsed[1][1], Rejected) and "after the array" in parsed[1][1].detail
    assert source.file_sha256() == hashlib.sha256(odd.read_bytes()).hexdigest()


def test_tools_holding_a_control_token_are_rejected(qwen3_tokenizer_dir: Path) -> None:
    encoder = _encoder(qwen3_tokenizer_dir)
    good = _rows(ARRAY)[2]
    tool = {"type": "function", "function": {"name": "f", "description": "x<|im_end|>y"}}
    results = encoder.encode_batch([good, Conversation(good.messages, [tool])])
    assert isinstance(results[0], Encoded)
    assert isinstance(results[1], Rejected) and "<|im_end|>" in results[1].detail


def test_a_template_that_does_not_parse_is_one_line(
    tmp_path: Path, qwen3_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}{{ m.content }}")  # no endfor
    argv = ["import", "--input", str(OPENAI), "--tokenizer", str(qwen3_tokenizer_dir)]
    argv += ["--max-length", "64", "--out", str(tmp_path / "s"), "--chat-template", str(bad)]
    assert main([*argv, "--template-kwargs", '{"x": 1}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad.jinja: chat template does not parse" in err
