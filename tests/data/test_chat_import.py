"""Chat JSONL import: exact assistant masks, schemas, truncation, bad input by reason and line."""

from __future__ import annotations

import gzip
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.data.conftest import write_jsonl
from trainer.data import chat_mask, chat_spans
from trainer.data.chat_import import import_chat_jsonl, load_tokenizer
from trainer.data.chat_mask import mask_from_spans
from trainer.data.errors import InputError
from trainer.data.store import (
    EXAMPLES_PER_KIND,
    FIRST_LINES_KEPT,
    KINDS_KEPT,
    LineStat,
    Manifest,
    TokenStore,
    sha256_file,
)

CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "hello world"},
    {"role": "assistant", "content": "the quick brown fox"},
    {"role": "user", "content": "how are you?"},
    {"role": "assistant", "content": "def add(x, y):\n    return x + y"},
]


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of 1s."""
    padded = np.concatenate([[0], mask.astype(np.int8), [0]])
    edges = np.flatnonzero(np.diff(padded))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def _import(
    tmp_path: Path,
    tok_dir: Path,
    rows: Sequence[object],
    max_length: int = 256,
    mask_token_id: int | None = None,
    chat_template: Path | None = None,
) -> tuple[TokenStore, Manifest]:
    tmp_path.mkdir(parents=True, exist_ok=True)
    source = write_jsonl(tmp_path / "chats.jsonl", rows)
    out = tmp_path / "store"
    manifest = import_chat_jsonl(
        source, tok_dir, max_length, out, mask_token_id=mask_token_id, chat_template=chat_template
    )
    return TokenStore.open(out, verify=True), manifest


@pytest.mark.parametrize("tok_fixture", ["qwen_tokenizer_dir", "generation_tokenizer_dir"])
def test_mask_is_exactly_assistant_content_plus_end_of_turn(
    tmp_path: Path, tok_fixture: str, request: pytest.FixtureRequest
) -> None:
    tok_dir = request.getfixturevalue(tok_fixture)
    store, manifest = _import(tmp_path, tok_dir, [{"conversations": CHAT}])
    tokenizer = load_tokenizer(tok_dir)
    tokens, mask = store.row(0)
    supervised = [tokenizer.decode(tokens[a:b].tolist()) for a, b in _runs(mask)]
    assert supervised == [m["content"] + "<|im_end|>" for m in CHAT if m["role"] == "assistant"]
    # Everything else (system, user, headers, the newline between turns) is unsupervised and
    # the row is the template's rendering token for token.
    rendered = tokenizer.apply_chat_template(CHAT, tokenize=False)
    assert tokenizer.decode(tokens.tolist()) == rendered
    assert manifest.mask_strategy == (
        "generation-tags" if tok_fixture == "generation_tokenizer_dir" else "sentinel-diff"
    )
    assert manifest.num_supervised_tokens == int(mask.sum())


def test_both_strategies_give_identical_rows(
    tmp_path: Path, qwen_tokenizer_dir: Path, generation_tokenizer_dir: Path
) -> None:
    rows = [
        {"conversations": CHAT},
        {
            "messages": [
                {"role": "user", "content": "é ü 你好"},
                {"role": "assistant", "content": "ok 好"},
            ]
        },
    ]
    a, _ = _import(tmp_path / "a", qwen_tokenizer_dir, rows)
    b, _ = _import(tmp_path / "b", generation_tokenizer_dir, rows)
    assert len(a) == len(b) == 2
    for i in range(2):
        assert a.row(i)[0].tolist() == b.row(i)[0].tolist()
        assert a.row(i)[1].tolist() == b.row(i)[1].tolist()


def test_three_schemas_import_identically(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    chat = CHAT[1:3]
    sharegpt = [
        {"from": "human", "value": chat[0]["content"]},
        {"from": "gpt", "value": chat[1]["content"]},
    ]
    openai_parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "hello "}, {"type": "text", "text": "world"}],
        },
        chat[1],
    ]
    rows = [
        {"conversations": chat},
        {"messages": chat},
        {"conversations": sharegpt},
        {"id": "x", "messages": openai_parts},
    ]
    store, manifest = _import(tmp_path, qwen_tokenizer_dir, rows)
    assert len(store) == 4 and manifest.num_skipped == 0
    first = store.row(0)
    for i in range(1, 4):
        assert store.row(i)[0].tolist() == first[0].tolist()
        assert store.row(i)[1].tolist() == first[1].tolist()


def test_truncation_keeps_prefix_and_counts_lines(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    long_answer = " ".join(["the quick brown fox"] * 40)
    short = {"conversations": CHAT[1:3]}
    long = {"conversations": [CHAT[1], {"role": "assistant", "content": long_answer}]}
    # Prompt alone exceeds the limit: nothing supervised survives the cut.
    prompt_heavy = {
        "conversations": [
            {"role": "user", "content": " ".join(["hello world"] * 40)},
            {"role": "assistant", "content": "ok"},
        ]
    }
    store, manifest = _import(
        tmp_path, qwen_tokenizer_dir, [short, long, prompt_heavy], max_length=32
    )
    full, _ = _import(tmp_path / "full", qwen_tokenizer_dir, [long], max_length=4096)
    assert len(store) == 2
    assert store.lengths.tolist()[1] == 32
    assert store.row(1)[0].tolist() == full.row(0)[0][:32].tolist()
    assert store.row(1)[1].tolist() == full.row(0)[1][:32].tolist()
    assert manifest.truncated.count == 1 and manifest.truncated.first_lines == [2]
    assert manifest.skipped["no_supervised_pair_after_truncation"].first_lines == [3]
    assert int(store.lengths.max()) <= manifest.max_length == 32
    # The skip says how long the row was and where its supervision began.
    whole, _ = _import(tmp_path / "whole", qwen_tokenizer_dir, [prompt_heavy], max_length=4096)
    tokens, mask = whole.row(0)
    begins = int(np.flatnonzero(mask)[0])
    assert begins > 32
    assert manifest.skipped["no_supervised_pair_after_truncation"].examples == [
        f"line 3: {tokens.size} tokens cut to --max-length 32; supervision begins at token {begins}"
    ]


def test_skip_examples_keep_every_kind_of_detail(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    """Many rows with one kind of problem do not hide a rarer one under the same reason: the
    first few examples are kept per kind of detail (numbers aside), not per reason."""
    rows: list[object] = [{"conversations": CHAT[1:3]}]
    for k in range(5):  # content a number at message k: one kind of detail, five strings
        turns = [{"role": "user", "content": "hi"}] * k + [{"role": "user", "content": 5}]
        rows.append({"conversations": [*turns, CHAT[2]]})
    image = {"type": "image_url", "image_url": {"url": "cat.png"}}
    rows.append({"conversations": [{"role": "user", "content": [image]}, CHAT[2]]})  # line 7
    _, manifest = _import(tmp_path, qwen_tokenizer_dir, rows)
    stat = manifest.skipped["bad_schema"]
    assert stat.count == 6
    assert stat.examples == [
        "line 2: message 0 content is a JSON number, not text",
        "line 3: message 1 content is a JSON number, not text",
        "line 7: message 0 content part 0 has type 'image_url' (read: text, reasoning, tool_call)",
    ]


def test_line_stat_bounds_its_examples() -> None:
    stat = LineStat()
    for kind in range(KINDS_KEPT + 3):
        for n in range(EXAMPLES_PER_KIND + 2):
            stat.add(1000 * kind + n, f"{'x' * (kind + 1)} at {n}")
        stat.add(1000 * kind + 99, f"{'x' * (kind + 1)} at 0")  # the same detail again
    assert len(stat.examples) == KINDS_KEPT * EXAMPLES_PER_KIND
    assert stat.examples[:3] == ["line 0: x at 0", "line 1: x at 1", "line 1000: xx at 0"]


def test_every_bad_input_reason_is_counted_with_its_line(
    tmp_path: Path, qwen_tokenizer_dir: Path
) -> None:
    good = {"conversations": CHAT[1:3]}
    rows: list[object] = [
        good,  # 1
        b'{"conversations": [',  # 2 malformed_json
        b'{"conversations": [{"role": "user", "content": "caf\xe9"}]}',  # 3 not_utf8 (latin-1)
        {"conversations": [{"role": "narrator", "content": "x"}]},  # 4 unknown_role
        {"conversations": []},  # 5 empty_conversation
        [1, 2, 3],  # 6 bad_schema: not an object
        {"conversations": [{"role": "user", "content": 5}]},  # 7 bad_schema: content
        {"conversations": [{"role": "user", "content": "hi"}]},  # 8 no_assistant_turn
        {"conversations": [CHAT[1], {"role": "assistant", "content": ""}]},  # 9 no_supervised_pair
        {"conversations": [CHAT[1], {"role": "assistant", "content": "a<|im_end|>b"}]},  # 10
        b"",  # 11 blank: ignored
        {"text": "no conversation key"},  # 12 bad_schema
        good,  # 13
        b"[" * 100_000 + b"]" * 100_000,  # 14 malformed_json: too deep for the parser
        b'{"id": ' + b"7" * 5000 + b"}",  # 15 malformed_json: integer too long
    ]
    store, manifest = _import(tmp_path, qwen_tokenizer_dir, rows)
    assert len(store) == 2
    got = {reason: stat.first_lines for reason, stat in manifest.skipped.items()}
    assert got == {
        "malformed_json": [2, 14, 15],
        "not_utf8": [3],
        "unknown_role": [4],
        "empty_conversation": [5],
        "bad_schema": [6, 7, 12],
        "no_assistant_turn": [8],
        "no_supervised_pair": [9],
        "control_token_in_content": [10],
    }
    assert manifest.params["blank_lines"] == 1 and manifest.params["lines"] == 15
    assert manifest.skipped["no_supervised_pair"].examples == [
        "line 9: 15 tokens, 1 supervised, never two in a row"  # the empty turn's <|im_end|>
    ]


def test_first_lines_are_capped_but_counts_are_not(
    tmp_path: Path, qwen_tokenizer_dir: Path
) -> None:
    rows: list[object] = [b"{oops"] * (FIRST_LINES_KEPT + 5) + [{"conversations": CHAT[1:3]}]
    _, manifest = _import(tmp_path, qwen_tokenizer_dir, rows)
    stat = manifest.skipped["malformed_json"]
    assert stat.count == FIRST_LINES_KEPT + 5
    assert stat.first_lines == list(range(1, FIRST_LINES_KEPT + 1))


# Qwen3-like: history is rendered without reasoning, the final turn gets a think block.
QWEN3_LIKE = (
    r"{%- for m in messages -%}"
    r"{%- if m['role'] == 'assistant' and loop.last -%}"
    r"{{ '<|im_start|>assistant\n<think>\n' + (m['reasoning_content'] or '') + '\n</think>\n\n' }}"
    r"{{ m['content'] + '<|im_end|>\n' }}"
    r"{%- else -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
)
# Like Qwen3 without reasoning_content: reasoning inline in content as <think>...</think>,
# moved into the think block for the final turn and dropped from history.
QWEN3_INLINE = (
    r"{%- for m in messages -%}"
    r"{%- if m['role'] == 'assistant' -%}"
    r"{%- set answer = m['content'].split('</think>')[-1].lstrip('\n') -%}"
    r"{%- set thought = m['content'].split('</think>')[0].split('<think>')[-1].strip('\n') "
    r"if '</think>' in m['content'] else '' -%}"
    r"{%- if loop.last -%}"
    r"{{ '<|im_start|>assistant\n<think>\n' + thought + '\n</think>\n\n' + answer + '<|im_end|>\n' }}"
    r"{%- else -%}{{ '<|im_start|>assistant\n' + answer + '<|im_end|>\n' }}{%- endif -%}"
    r"{%- else -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
)
# Drops every assistant turn but the last (some reasoning templates do).
LAST_ONLY = (
    r"{%- for m in messages -%}"
    r"{%- if m['role'] != 'assistant' or loop.last -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
)
# Echoes the final answer once more at the end: its text is in two places.
ECHO_LAST = (
    r"{%- for m in messages -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endfor -%}"
    r"{{ '<|im_start|>system\nrecap: ' + messages[-1]['content'] + '<|im_end|>\n' }}"
)


@pytest.mark.parametrize(
    ("template", "expected", "unlocated"),
    [
        (
            QWEN3_LIKE,
            [
                CHAT[2]["content"] + "<|im_end|>",
                "<think>\nthink hard\n</think>\n\n" + CHAT[4]["content"] + "<|im_end|>",
            ],
            0,
        ),
        (
            QWEN3_INLINE,
            [
                CHAT[2]["content"] + "<|im_end|>",
                "<think>\ninline idea\n</think>\n\n" + CHAT[4]["content"] + "<|im_end|>",
            ],
            0,
        ),
        (LAST_ONLY, [CHAT[4]["content"] + "<|im_end|>"], 1),
        (ECHO_LAST, [CHAT[2]["content"] + "<|im_end|>"], 1),
    ],
)
def test_templates_that_rewrite_history(
    tmp_path: Path,
    qwen_tokenizer_dir: Path,
    template: str,
    expected: list[str],
    unlocated: int,
) -> None:
    (tmp_path / "t.jinja").write_text(template)
    chat = [*CHAT[:4], dict(CHAT[4], reasoning_content="think hard")]
    chat[2] = dict(chat[2], reasoning_content="old thoughts")  # not rendered in history
    if template is QWEN3_INLINE:
        chat[2] = dict(CHAT[2], content="<think>\nold idea\n</think>\n\n" + CHAT[2]["content"])
        chat[4] = dict(CHAT[4], content="<think>\ninline idea\n</think>\n\n" + CHAT[4]["content"])
    store, manifest = _import(
        tmp_path, qwen_tokenizer_dir, [{"messages": chat}], chat_template=tmp_path / "t.jinja"
    )
    tokenizer = load_tokenizer(qwen_tokenizer_dir)
    tokens, mask = store.row(0)
    assert [tokenizer.decode(tokens[a:b].tolist()) for a, b in _runs(mask)] == expected
    assert manifest.params["unlocated_turns"] == unlocated


def test_manifest_identifies_source_and_tokenizer(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    store, manifest = _import(tmp_path, qwen_tokenizer_dir, [{"conversations": CHAT}])
    source = tmp_path / "chats.jsonl"
    assert manifest.source == str(source.absolute())
    assert manifest.source_sha256 == hashlib.sha256(source.read_bytes()).hexdigest()
    ident = manifest.tokenizer
    assert ident is not None and ident.files["tokenizer.json"] == sha256_file(
        qwen_tokenizer_dir / "tokenizer.json"
    )
    assert "chat_template.jinja" in ident.files
    assert manifest.vocab_size == len(load_tokenizer(qwen_tokenizer_dir))
    assert int(store.tokens.max()) < manifest.vocab_size
    on_disk = json.loads((store.path / "manifest.json").read_text())
    assert on_disk["kind"] == "chat-import" and on_disk["max_length"] == 256


def test_gzip_input_matches_plain(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    plain = write_jsonl(tmp_path / "c.jsonl", [{"conversations": CHAT}])
    gz = tmp_path / "c.jsonl.gz"
    gz.write_bytes(gzip.compress(plain.read_bytes()))
    import_chat_jsonl(plain, qwen_tokenizer_dir, 256, tmp_path / "p")
    import_chat_jsonl(gz, qwen_tokenizer_dir, 256, tmp_path / "g")
    p, g = TokenStore.open(tmp_path / "p"), TokenStore.open(tmp_path / "g")
    assert p.row(0)[0].tolist() == g.row(0)[0].tolist()
    assert g.manifest.source_sha256 == sha256_file(gz)  # the file as stored, like sha256sum


def test_no_usable_rows_writes_nothing(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    source = write_jsonl(tmp_path / "bad.jsonl", [b"{x", {"messages": []}])
    with pytest.raises(
        InputError, match=r"bad\.jsonl: no usable rows in 2 lines .*malformed_json=1"
    ):
        import_chat_jsonl(source, qwen_tokenizer_dir, 64, tmp_path / "store")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl"]


def test_whole_input_errors_name_the_path(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"conversations": CHAT}])
    with pytest.raises(InputError, match=r"missing\.jsonl: input file not found"):
        import_chat_jsonl(tmp_path / "missing.jsonl", qwen_tokenizer_dir, 64, tmp_path / "s")
    with pytest.raises(InputError, match=r"nodir: tokenizer directory not found"):
        import_chat_jsonl(source, tmp_path / "nodir", 64, tmp_path / "s")
    empty_dir = tmp_path / "emptytok"
    empty_dir.mkdir()
    with pytest.raises(InputError, match=r"emptytok: cannot load tokenizer"):
        import_chat_jsonl(source, empty_dir, 64, tmp_path / "s")
    assert not (tmp_path / "s").exists()


@given(
    tokens=st.lists(st.tuples(st.integers(0, 60), st.integers(0, 8)), max_size=40),
    cuts=st.lists(st.integers(0, 80), max_size=8, unique=True),
)
def test_mask_from_spans_is_interval_overlap(
    tokens: list[tuple[int, int]], cuts: list[int]
) -> None:
    offsets = sorted((start, start + width) for start, width in tokens)
    edges = sorted(cuts)
    spans = [(a, b) for a, b in zip(edges[::2], edges[1::2], strict=False) if b > a]
    expected = [int(any(end > a and start < b for a, b in spans)) for start, end in offsets]
    assert mask_from_spans(offsets, spans).tolist() == expected


def test_worker_processes_give_the_same_store(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    chat = {"conversations": CHAT}
    rows: list[object] = [chat, b"{bad", *([chat] * 9), {"messages": []}, chat]
    source = write_jsonl(tmp_path / "c.jsonl", rows)
    one = import_chat_jsonl(source, qwen_tokenizer_dir, 64, tmp_path / "one", chunk_rows=2)
    two = import_chat_jsonl(
        source, qwen_tokenizer_dir, 64, tmp_path / "two", chunk_rows=2, workers=2
    )
    assert {k: v.sha256 for k, v in one.files.items()} == {
        k: v.sha256 for k, v in two.files.items()
    }
    assert one.skipped == two.skipped and one.truncated == two.truncated
    assert two.num_rows == 11 and two.skipped.keys() == {"malformed_json", "empty_conversation"}


NO_TOOLS = (
    r"{%- for m in messages -%}"
    r"{%- if m['role'] == 'tool' -%}{{ raise_exception('tool messages unsupported') }}{%- endif -%}"
    r"{%- if m['role'] == 'assistant' -%}"
    r"{{ '<|im_start|>assistant\n' }}{% generation %}{{ m['content'] + '<|im_end|>' }}"
    r"{% endgeneration %}{{ '\n' }}"
    r"{%- else -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
)


@pytest.mark.parametrize("tags", [True, False], ids=["generation-tags", "sentinel-diff"])
def test_template_error_is_isolated_to_its_row(
    tmp_path: Path, qwen_tokenizer_dir: Path, tags: bool
) -> None:
    template = tmp_path / "no_tools.jinja"
    text = (
        NO_TOOLS
        if tags
        else NO_TOOLS.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    )
    template.write_text(text)
    tool = {"role": "tool", "content": "42"}
    rows: list[object] = [{"conversations": CHAT}, {"conversations": [*CHAT[:3], tool, *CHAT[3:]]}]
    store, manifest = _import(
        tmp_path, qwen_tokenizer_dir, [*rows, rows[0]], chat_template=template
    )
    assert manifest.mask_strategy == ("generation-tags" if tags else "sentinel-diff")
    assert len(store) == 2 and store.row(1)[1].sum() > 0
    assert manifest.skipped["template_error"].first_lines == [2]
    assert manifest.tokenizer is not None
    assert "chat_template (override)" in manifest.tokenizer.files


def test_mask_token_id_must_be_outside_the_tokenizer(
    tmp_path: Path, qwen_tokenizer_dir: Path
) -> None:
    size = len(load_tokenizer(qwen_tokenizer_dir))
    with pytest.raises(
        InputError, match=rf"--mask-token-id 2: is token '<\|im_end\|>' .* >= {size}"
    ):
        _import(tmp_path / "a", qwen_tokenizer_dir, [{"conversations": CHAT}], mask_token_id=2)
    store, manifest = _import(
        tmp_path / "b", qwen_tokenizer_dir, [{"conversations": CHAT}], mask_token_id=size + 3
    )
    assert manifest.mask_token_id == size + 3 and manifest.reserved_token_ids == [size + 3]
    assert store.manifest.vocab_size == size  # ids in the store stay below the tokenizer size


def test_one_pass_and_per_turn_diff_agree(
    tmp_path: Path, qwen_tokenizer_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tricky = [
        {"role": "user", "content": "\nhello\n"},
        {"role": "assistant", "content": "\n\nleading and trailing newlines\n\n"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "é 你好 \t tabs"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "x"},
    ]
    rows: list[object] = [{"conversations": CHAT}, {"conversations": tricky}]
    original = chat_spans.spans_one_pass
    answers: list[object] = []

    def spy(control, full, variant, turns):  # type: ignore[no-untyped-def]
        answers.append(original(control, full, variant, turns))
        return answers[-1]

    monkeypatch.setattr(chat_mask, "spans_one_pass", spy)
    _, fast_manifest = _import(tmp_path / "fast", qwen_tokenizer_dir, rows)
    assert len(answers) == 2 and None not in answers  # both rows took the one-pass path
    monkeypatch.setattr(chat_mask, "spans_one_pass", lambda *args: None)
    _, slow_manifest = _import(tmp_path / "slow", qwen_tokenizer_dir, rows)
    assert fast_manifest.files == slow_manifest.files
    assert fast_manifest.num_supervised_tokens > 0


TOOLS_TEMPLATE = (
    r"{%- for m in messages -%}"
    r"{%- if m['role'] == 'assistant' -%}"
    r"{{ '<|im_start|>assistant\n' + m['content'] }}"
    r"{%- if m['tool_calls'] is defined -%}{%- for call in m['tool_calls'] -%}"
    r"{{ '\n<tool_call>\n' + (call['function'] | tojson) + '\n</tool_call>' }}"
    r"{%- endfor -%}{%- endif -%}"
    r"{{ '<|im_end|>\n' }}"
    r"{%- elif m['role'] == 'tool' -%}"
    r"{{ '<|im_start|>user\n<tool_response>\n' + m['content'] + '\n</tool_response><|im_end|>\n' }}"
    r"{%- else -%}"
    r"{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    r"{%- endif -%}"
    r"{%- endfor -%}"
)


def test_tool_calls_are_supervised_tool_results_are_not(
    tmp_path: Path, qwen_tokenizer_dir: Path
) -> None:
    (tmp_path / "t.jinja").write_text(TOOLS_TEMPLATE)
    call = {"type": "function", "function": {"name": "add", "arguments": {"x": 1, "y": 2}}}
    chat = [
        {"role": "user", "content": "hello world"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "3"},
        {"role": "assistant", "content": "the quick brown fox"},
    ]
    bad = [chat[0], {"role": "assistant", "content": None, "tool_calls": [{"oops": 1}]}]
    store, manifest = _import(
        tmp_path,
        qwen_tokenizer_dir,
        [{"messages": chat}, {"messages": bad}],
        chat_template=tmp_path / "t.jinja",
    )
    tokenizer = load_tokenizer(qwen_tokenizer_dir)
    tokens, mask = store.row(0)
    supervised = [tokenizer.decode(tokens[a:b].tolist()) for a, b in _runs(mask)]
    assert len(supervised) == 2
    assert supervised[0].startswith("\n<tool_call>\n{") and '"name": "add"' in supervised[0]
    assert supervised[0].endswith("\n</tool_call><|im_end|>")
    assert supervised[1] == "the quick brown fox<|im_end|>"
    assert "<tool_response>" not in "".join(supervised)
    assert manifest.skipped["bad_schema"].first_lines == [2]
    assert manifest.params["unlocated_turns"] == 0
