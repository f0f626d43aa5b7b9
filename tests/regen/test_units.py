"""The pure parts of trainer.regen: reading replies, the think guard per mode, the turns of a
source row and its id, the status line, and OUT's whole-line files as a resume reads them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.conftest import tmpfs
from trainer.data.conversations import Conversation, normalise_conversation
from trainer.data.served import RegenManifest
from trainer.events import RegenEvent, format_regen_line, parse_line
from trainer.regen.output import LineFile, OutputError, check_resume, encode, errors_path, scan
from trainer.regen.replies import Reply, ReplyError, parse_reply, think_problem
from trainer.regen.rows import plan_turns, row_id


def completion(message: dict[str, Any], **more: Any) -> dict[str, Any]:
    return {
        "choices": [{"message": message, "finish_reason": "stop", **more}],
        **more.pop("top", {}),
    }


def reply(content: str = "hi", reasoning: str | None = None) -> Reply:
    return Reply(content, reasoning, (), "stop", 1, 1, None, None)


def test_reasoning_is_read_from_vllm_and_sglang_names_and_ids_where_returned() -> None:
    vllm = parse_reply(
        {
            "prompt_token_ids": [1, 2],
            "choices": [
                {
                    "message": {"content": "a", "reasoning": "r"},
                    "token_ids": [3],
                    "finish_reason": "stop",
                }
            ],
            "usage": {"prompt_tokens": 2, "completion_tokens": 1},
        }
    )
    assert (vllm.reasoning, vllm.prompt_ids, vllm.completion_ids) == ("r", (1, 2), (3,))
    sglang = parse_reply(
        {
            "choices": [
                {"message": {"content": None, "reasoning_content": "r"}, "finish_reason": "length"}
            ]
        }
    )
    assert (sglang.content, sglang.reasoning, sglang.prompt_ids, sglang.finish_reason) == (
        "",
        "r",
        None,
        "length",
    )
    with pytest.raises(ReplyError, match="no choices"):
        parse_reply({"object": "error"})
    with pytest.raises(ReplyError, match="function name"):
        parse_reply({"choices": [{"message": {"content": "", "tool_calls": [{"function": {}}]}}]})


@pytest.mark.parametrize(
    ("mode", "content", "reasoning", "refused"),
    [
        ("disable", "plain", None, None),
        ("disable", "<think>x</think>plain", None, "'<think>' with --reasoning disable"),
        ("disable", "plain", "thought", "returned reasoning with --reasoning disable"),
        ("save", "plain", "thought", None),
        ("save", "plain", None, None),
        ("save", "x</think>plain", "thought", "'</think>' marker is left in the content"),
        ("save", "plain", "<think>thought", "'<think>' marker is left in the reasoning"),
        ("none", "<think>x</think>plain", "y", None),
    ],
)
def test_the_think_guard_per_mode(
    mode: str, content: str, reasoning: str | None, refused: str | None
) -> None:
    problem = think_problem(reply(content, reasoning), mode)
    assert (problem is None) == (refused is None)
    if refused is not None:
        assert problem is not None and refused in problem


def conversation(row: dict[str, Any]) -> Conversation:
    c = normalise_conversation(row)
    assert isinstance(c, Conversation)
    return c


def test_turns_carry_the_users_messages_and_the_tool_results_never_the_answers() -> None:
    call = {"type": "function", "function": {"name": "f", "arguments": {}}}
    row = conversation(
        {
            "messages": [
                {"role": "system", "content": "s"},
                {"role": "user", "content": "u1"},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "r1"},
                {"role": "assistant", "content": "a1"},
                {"role": "user", "content": "u2"},
                {"role": "assistant", "content": "a2"},
                {"role": "user", "content": "trailing, unanswered"},
            ]
        }
    )
    turns = plan_turns(row.messages)
    assert not isinstance(turns, str)
    assert [[m["content"] for m in t.context] for t in turns] == [["s", "u1"], ["u2"]]
    assert [[m["content"] for m in t.results] for t in turns] == [["r1"], []]
    assert plan_turns(
        conversation({"messages": [{"role": "assistant", "content": "x"}]}).messages
    ) == ("message 0 is an assistant reply with no user message before it")


def test_the_id_is_the_rows_content_whatever_its_format() -> None:
    sharegpt = conversation(
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]}
    )
    openai = conversation(
        {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    )
    other = conversation(
        {"messages": [{"role": "user", "content": "q2"}, {"role": "assistant", "content": "a"}]}
    )
    assert row_id(sharegpt) == row_id(openai) != row_id(other)
    assert len(row_id(openai)) == 32


def test_the_status_line_reads_back() -> None:
    ev = RegenEvent(
        elapsed_min=3, finished=12, total=100, errors=1, length=2, rows_s=0.5, gen_tok_s=123.4,
        prompt_tok_s=456.7, in_flight=[4, 0], eta_s=600.0, extra={"down": "1", "retries": "7"},
    )  # fmt: skip
    line = format_regen_line(ev)
    assert line.startswith("Regen: [3m] rows=12/100 errors=1 length=2 | 0.50rows/s")
    assert parse_line(line) == ev
    assert parse_line(line).extra_int("retries") == 7  # type: ignore[union-attr]


MANIFEST = RegenManifest(
    model="m",
    reasoning="disable",
    chat_template_kwargs={"enable_thinking": False},
    temperature=0.0,
    max_tokens=8,
)


def write_out(path: Path, ids: list[str]) -> None:
    lines = [MANIFEST.line() + "\n"] + [encode({"id": i, "messages": []}).decode() for i in ids]
    path.write_text("".join(lines))


def test_a_resume_reads_ids_and_cuts_a_torn_or_unreadable_last_line(tmp_path: Path) -> None:
    out = tmp_path / "out.jsonl"
    ids = [f"{k:032x}" for k in range(3)]
    write_out(out, ids)
    whole = out.stat().st_size
    with out.open("a") as fh:
        fh.write('{"id":"' + "f" * 20)  # torn mid-write
    found = scan(out, with_manifest=True)
    assert found.ids == set(ids) and found.manifest == MANIFEST
    assert found.cut_bytes == 27 and out.stat().st_size == whole
    with out.open("a") as fh:
        fh.write("garbage\n")
    found = scan(out, with_manifest=True)
    assert (
        found.ids == set(ids) and "is not a row" in found.cut_reason and out.stat().st_size == whole
    )
    with out.open("a") as fh:
        fh.write("garbage\n" + encode({"id": "e" * 32}).decode())
    with pytest.raises(OutputError, match=r"out.jsonl:5: not a row with an id"):
        scan(out, with_manifest=True)


def test_a_resume_refuses_a_file_made_another_way_by_name(tmp_path: Path) -> None:
    other = MANIFEST.model_copy(update={"reasoning": "save", "max_tokens": 16})
    with pytest.raises(
        OutputError, match=r"reasoning: \"disable\" in the file, \"save\" now; max_tokens: 8"
    ):
        check_resume(tmp_path / "o.jsonl", MANIFEST, other)
    check_resume(
        tmp_path / "o.jsonl", MANIFEST, MANIFEST.model_copy(update={"created_at": "later"})
    )


def test_a_failed_write_leaves_no_torn_line(tmp_path: Path) -> None:
    """A line longer than what is left on a real (tmpfs) filesystem: part of it lands, then
    ENOSPC; the file is cut back to its last whole line and the error names it."""
    with tmpfs(tmp_path / "small", "16k") as disk:
        path = disk / "o.jsonl"
        path.write_text("kept\n")
        lines = LineFile(path)
        with pytest.raises(
            OutputError,
            match=r"o.jsonl: write failed: No space left on device; the file is cut back",
        ):
            lines.write(b"x" * 65536 + b"\n")
        lines.close()
        assert path.read_text() == "kept\n"
    assert errors_path(Path("a/regen.jsonl")) == Path("a/regen.errors.jsonl")
    assert errors_path(Path("a/regen")) == Path("a/regen.errors.jsonl")
