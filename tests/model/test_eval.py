"""The eval CLI on real prompt sets: formats, the real Qwen3 chat template, multi-turn MT-Bench,
default EOS, fail-fast validation before any model loads, and the z-lab counting protocol."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import PreTrainedTokenizerBase

from tests import budget
from tests.model.conftest import QWEN3_EOS, QWEN3_VOCAB
from tests.model.helpers import make_drafter
from trainer import eval as eval_cli
from trainer.eval_prompts import (
    ZLAB_MATH_SUFFIX,
    ChatPrompt,
    PromptError,
    Renderer,
    TokenPrompt,
    read_prompt_set,
    run_turns,
)
from trainer.model.export import export_drafter
from trainer.model.fit import fit, greedy_continuations
from trainer.model.speculative import speculative_generate
from trainer.model.target import TargetModel

REPO = Path(__file__).resolve().parents[2]
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "eval-prompts"
MT_BENCH = FIXTURES / "mt_bench_question.jsonl"
GSM8K = FIXTURES / "gsm8k_test.jsonl"
OPENAI = FIXTURES / "openai_messages.jsonl"
QWEN3_MASK = QWEN3_VOCAB - 1  # a padding row past the tokenizer's ids, never emitted


def _tokenizer(path: Path) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    tok: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(path, local_files_only=True)
    return tok


def _decode(tok: PreTrainedTokenizerBase, ids: list[int]) -> str:
    text = tok.decode(ids)  # one sequence in, one string out
    assert isinstance(text, str)
    return text


def _chat(prompt: TokenPrompt | ChatPrompt) -> ChatPrompt:
    assert isinstance(prompt, ChatPrompt)
    return prompt


# --- reading prompt sets (no tokenizer, no model) ---------------------------------------------


def test_published_prompt_formats_parse_as_conversations() -> None:
    """MT-Bench turns, gsm8k questions and OpenAI messages (reference answer dropped, text parts
    joined, tools kept) each become a chat prompt."""
    mt = read_prompt_set(MT_BENCH)
    assert mt.forms == {"mt-bench": 3} and mt.turns == 6
    first = mt.prompts[0]
    assert isinstance(first, ChatPrompt) and first.history == [] and len(first.turns) == 2
    assert first.turns[1].startswith("Rewrite your note")

    gsm = read_prompt_set(GSM8K)
    assert gsm.forms == {"gsm8k": 2}
    assert _chat(gsm.prompts[0]).turns == [
        json.loads(GSM8K.read_text().splitlines()[0])["question"]
    ]

    oa = read_prompt_set(OPENAI)
    sys_row, tool_row = oa.prompts
    assert isinstance(sys_row, ChatPrompt) and isinstance(tool_row, ChatPrompt)
    assert sys_row.history == [{"role": "system", "content": "You are a terse assistant."}]
    assert sys_row.turns == ["Name a prime number between 20 and 30."]  # not the answer "23"
    assert tool_row.turns == ["What is the weather in Oslo right now?"]
    assert tool_row.tools is not None and tool_row.tools[0]["function"]["name"] == "get_weather"


def test_question_suffix_reaches_gsm8k_and_math_questions(tmp_path: Path) -> None:
    """z-lab appends its "reason step by step ... \\boxed{}" suffix to gsm8k and MATH-500."""
    path = tmp_path / "p.jsonl"
    path.write_text('{"problem": "1 + 1?", "answer": "2"}\n{"turns": ["hi"]}\n')
    math, chat = map(_chat, read_prompt_set(path, question_suffix=ZLAB_MATH_SUFFIX).prompts)
    assert math.turns == [
        "1 + 1?\nPlease reason step by step, and put your final answer within \\boxed{}."
    ]
    assert chat.turns == ["hi"]  # MT-Bench-style turns are sent as they are
    gsm = _chat(read_prompt_set(GSM8K, question_suffix=" Answer briefly.").prompts[0])
    assert gsm.turns[0].endswith("left? Answer briefly.")


def test_token_id_rows_stay_token_ids(tmp_path: Path) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text('[1, 2, 3]\n\n{"input_ids": [4, 5]}\n')
    pset = read_prompt_set(path)
    assert pset.prompts == [TokenPrompt(1, [1, 2, 3]), TokenPrompt(3, [4, 5])]
    assert not pset.needs_tokenizer


@pytest.mark.parametrize(
    ("content", "fragment"),
    [
        ("[1, 2\n", "p.jsonl:1: invalid JSON"),
        ("[1]\n[]\n", "p.jsonl:2: expected a non-empty list of token ids"),
        ('[1]\n{"instruction": "x", "output": "y"}\n', "p.jsonl:2: no prompt in this row"),
        ('{"turns": []}\n', "p.jsonl:1: 'turns' must be a non-empty string"),
        ('{"messages": [{"role": "bot", "content": "x"}]}\n', "p.jsonl:1: messages[0]: role 'bot'"),
        ('{"messages": [{"role": "assistant", "content": "x"}]}\n', "no user message"),
        ('[{"text": "a"},\n {"text": "b"}]\n', "p.jsonl: one JSON array, not JSONL"),
        ("\n", "p.jsonl: no prompts"),
    ],
)
def test_bad_prompt_rows_name_file_and_line(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(PromptError) as info:
        read_prompt_set(path)
    assert fragment in str(info.value)
    assert "\n" not in str(info.value)


# --- rendering with the real Qwen3 tokenizer and template --------------------------------------


def test_chat_template_and_template_kwargs_reach_the_prompt(qwen3_tokenizer_dir: Path) -> None:
    """The first MT-Bench turn is rendered by Qwen3's own template; enable_thinking=false adds
    the empty think block Qwen3 expects in non-thinking mode."""
    tok = _tokenizer(qwen3_tokenizer_dir)
    prompt = _chat(read_prompt_set(MT_BENCH).prompts[1])
    question = prompt.turns[0]
    default = Renderer(tok, QWEN3_VOCAB).first_ids(prompt, "q:2")
    assert _decode(tok, default) == (
        f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
    )
    no_think = Renderer(tok, QWEN3_VOCAB, {"enable_thinking": False}).first_ids(prompt, "q:2")
    assert _decode(tok, no_think).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_openai_rows_render_system_and_tools(qwen3_tokenizer_dir: Path) -> None:
    tok = _tokenizer(qwen3_tokenizer_dir)
    renderer = Renderer(tok, QWEN3_VOCAB)
    sys_row, tool_row = read_prompt_set(OPENAI).prompts
    text = _decode(tok, renderer.first_ids(sys_row, "o:1"))
    assert text.startswith("<|im_start|>system\nYou are a terse assistant.<|im_end|>")
    assert "23" not in text
    tools_text = _decode(tok, renderer.first_ids(tool_row, "o:2"))
    assert "<tools>" in tools_text and '"name": "get_weather"' in tools_text


def test_mt_bench_feeds_the_models_own_first_answer_back(qwen3_tokenizer_dir: Path) -> None:
    """Turn 2 is rendered after turn 1's answer joined the conversation, decoded without
    special tokens (what z-lab's benchmark and FastChat do)."""
    tok = _tokenizer(qwen3_tokenizer_dir)
    renderer = Renderer(tok, QWEN3_VOCAB)
    prompt = _chat(read_prompt_set(MT_BENCH).prompts[0])
    answers: list[list[int]] = [
        tok("Lisbon: sardines, and the view from the castle.")["input_ids"] + [151645]
    ]
    answers.append(tok("Lovely Lisbon.")["input_ids"] + [151645])
    seen: list[list[int]] = []

    def generate(ids: list[int]) -> list[int]:
        seen.append(ids)
        return answers[len(seen) - 1]

    turn_ids = run_turns(prompt, renderer, "q:1", generate)
    assert turn_ids == seen and len(seen) == 2
    second = _decode(tok, seen[1])
    assert second == (
        f"<|im_start|>user\n{prompt.turns[0]}<|im_end|>\n"
        "<|im_start|>assistant\nLisbon: sardines, and the view from the castle.<|im_end|>\n"
        f"<|im_start|>user\n{prompt.turns[1]}<|im_end|>\n<|im_start|>assistant\n"
    )


def test_token_ids_outside_the_target_vocabulary_are_refused(qwen3_tokenizer_dir: Path) -> None:
    tok = _tokenizer(qwen3_tokenizer_dir)
    prompt = read_prompt_set(MT_BENCH).prompts[0]
    with pytest.raises(PromptError, match=r"q:1: token id \d+ outside the target vocabulary"):
        Renderer(tok, 512).first_ids(prompt, "q:1")


# --- the CLI ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def qwen3_export(qwen3_target: TargetModel, tmp_path_factory: pytest.TempPathFactory) -> Path:
    drafter = make_drafter(qwen3_target, block_size=4, mask_token_id=QWEN3_MASK)
    return export_drafter(drafter, tmp_path_factory.mktemp("qwen3-drafter"))


def test_cli_runs_mt_bench_question_jsonl_as_it_is(
    qwen3_target_dir: Path, qwen3_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """MT-Bench + gsm8k through the real Qwen3 tokenizer found in the target directory, EOS
    from the tokenizer and generation_config, tau per prompt set, protocol on every figure."""
    out = tmp_path / "r.json"
    rc = eval_cli.main(
        [
            "--target",
            str(qwen3_target_dir),
            "--drafter",
            str(qwen3_export),
            "--prompts",
            str(MT_BENCH),
            str(GSM8K),
            "--template-kwargs",
            '{"enable_thinking": false}',
            "--max-new-tokens",
            "5",
            "--device",
            "cpu",
            "--json",
            str(out),
        ]
    )
    text = capsys.readouterr().out
    assert rc == 0, text
    assert "stop at 151645 <|im_end|>, 151643 <|endoftext|>" in text
    assert "set mt_bench_question.jsonl: tau=" in text and "set gsm8k_test.jsonl: tau=" in text
    summary_lines = [line for line in text.splitlines() if "tau=" in line and "prompt " not in line]
    assert len(summary_lines) == 3 and all("(protocol exact," in line for line in summary_lines)
    data = json.loads(out.read_text())
    assert data["protocol"] == "exact" and data["stop_ids"] == QWEN3_EOS
    assert [s["name"] for s in data["sets"]] == ["mt_bench_question.jsonl", "gsm8k_test.jsonl"]
    assert [s["prompts"] for s in data["sets"]] == [6, 2]  # 3 questions x 2 turns, 2 questions
    mt = [p for p in data["prompts"] if p["set"] == "mt_bench_question.jsonl"]
    assert [(p["line"], p["turn"]) for p in mt] == [(1, 1), (1, 2), (2, 1), (2, 2), (3, 1), (3, 2)]
    for t1, t2 in zip(mt[::2], mt[1::2], strict=True):
        assert t2["prompt_tokens"] > t1["prompt_tokens"]  # turn 1 and its answer came first
    assert data["summary"]["matches"] == data["summary"]["prompts"] == 8


def _corrupt_target(qwen3_target_dir: Path, dest: Path) -> Path:
    """The Qwen3-vocab target's config + tokenizer, but weights that cannot load."""
    dest.mkdir()
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        shutil.copyfile(qwen3_target_dir / name, dest / name)
    (dest / "model.safetensors").write_bytes(b"not a safetensors file")
    return dest


def test_bad_prompts_fail_before_any_model_loads(
    qwen3_target_dir: Path, qwen3_export: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """With a target whose weights cannot load, prompt errors still come first: they were found
    before the model was touched, in one line naming file and line."""
    target = _corrupt_target(qwen3_target_dir, tmp_path / "target")
    base = ["--target", str(target), "--drafter", str(qwen3_export), "--device", "cpu"]
    cases = [
        ('{"turns": ["fine"]}\n{"turns": "oops"', "p.jsonl:2: invalid JSON"),
        ('{"turns": ["fine"]}\n{"answer": "7"}\n', "p.jsonl:2: no prompt in this row"),
        (f"[5, 6]\n[{QWEN3_VOCAB}]\n", f"p.jsonl:2: token id {QWEN3_VOCAB} outside"),
    ]
    for content, fragment in cases:
        prompts = tmp_path / "p.jsonl"
        prompts.write_text(content)
        assert eval_cli.main([*base, "--prompts", str(prompts)]) == 2
        err = capsys.readouterr().err.strip()
        assert fragment in err and err.count("\n") == 0, err
    bad_kwargs = [*base, "--prompts", str(MT_BENCH), "--template-kwargs", "[1]"]
    assert eval_cli.main(bad_kwargs) == 2
    assert "--template-kwargs: expected a JSON object" in capsys.readouterr().err
    typo = [*base, "--prompts", str(MT_BENCH), "--template-kwargs", '{"enable_thinkng": false}']
    assert eval_cli.main(typo) == 2
    assert "'enable_thinkng' never read by the chat template" in capsys.readouterr().err
    # Good prompts reach the model load, which fails: the cases above never got that far.
    assert eval_cli.main([*base, "--prompts", str(MT_BENCH)]) == 2
    assert "cannot load target model" in capsys.readouterr().err


def test_cli_exits_2_with_one_line_on_a_missing_export_or_tokenizer(
    target: TargetModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[1, 2]\n")
    argv = ["--target", str(target.model.name_or_path), "--prompts", str(prompts)]
    assert eval_cli.main([*argv, "--drafter", str(tmp_path / "missing"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "not a drafter export" in err
    # Text prompts, and the target directory (the default tokenizer) has no tokenizer.
    prompts.write_text('{"question": "2 + 2?"}\n')
    drafter = export_drafter(make_drafter(target), tmp_path / "d")
    assert eval_cli.main([*argv, "--drafter", str(drafter), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no tokenizer here" in err and "--tokenizer" in err, err


def test_cli_writes_json_results_for_token_id_prompts(target: TargetModel, tmp_path: Path) -> None:
    """Token-id prompts need no tokenizer (the tiny target has none): no EOS, full length."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[5, 6, 7]\n[8, 9]\n")
    out = tmp_path / "r.json"
    argv = ["--target", str(target.model.name_or_path), "--prompts", str(prompts)]
    drafter = export_drafter(make_drafter(target), tmp_path / "d")
    rc = eval_cli.main(
        [*argv, "--drafter", str(drafter), "--max-new-tokens", "6", "--json", str(out)]
    )
    data = json.loads(out.read_text())
    assert rc == 0
    assert data["stop_ids"] == []
    assert data["summary"]["prompts"] == 2 and data["summary"]["matches"] == 2
    assert [p["new_tokens"] for p in data["prompts"]] == [6, 6]
    assert data["summary"]["tau"] >= 1.0


def test_raw_text_rows_skip_the_template(tmp_path: Path) -> None:
    """--raw-text: {"text"} is tokenised as is (a word-level tokenizer without a template)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "hello": 1, "tiny": 2, "world": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    # transformers leaves the fast tokenizer's __init__ unannotated.
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")  # type: ignore[no-untyped-call]
    path = tmp_path / "p.jsonl"
    path.write_text('{"text": "hello tiny world"}\n[7]\n')
    renderer = Renderer(fast, 512)
    raw = read_prompt_set(path, raw_text=True)
    assert [renderer.first_ids(p, "p") for p in raw.prompts] == [[1, 2, 3], [7]]
    templated = read_prompt_set(path).prompts[0]
    with pytest.raises(PromptError, match="no chat template"):
        renderer.first_ids(templated, "p:1")


# --- counting protocols -----------------------------------------------------------------------


def test_zlab_protocol_counts_one_more_step_when_tokens_land_on_the_limit(
    target: TargetModel,
) -> None:
    """Same tokens; z-lab's loop verifies once more when the committed count equals the limit
    (and once after a first token that is already EOS), so its tau is lower there."""
    drafter = make_drafter(target, block_size=4)
    prompt = [5, 17, 42, 99, 3]
    free = speculative_generate(target, drafter, prompt, 30)
    # 1 prefill token + the first k steps: a limit the committed tokens land on exactly.
    k = 3
    limit = 1 + sum(free.accept_lengths[:k])
    exact = speculative_generate(target, drafter, prompt, limit)
    zlab = speculative_generate(target, drafter, prompt, limit, protocol="zlab")
    assert exact.tokens == zlab.tokens == free.tokens[:limit]
    assert exact.accept_lengths == free.accept_lengths[:k]
    assert zlab.accept_lengths == free.accept_lengths[: k + 1]

    eos = free.tokens[0]
    assert speculative_generate(target, drafter, prompt, 30, eos).accept_lengths == []
    first_eos = speculative_generate(target, drafter, prompt, 30, eos, protocol="zlab")
    assert first_eos.tokens == [eos] and len(first_eos.accept_lengths) == 1


def test_cli_protocol_zlab_is_named_on_every_figure(
    target: TargetModel, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[5, 6, 7]\n")
    drafter = export_drafter(make_drafter(target), tmp_path / "d")
    argv = ["--target", str(target.model.name_or_path), "--drafter", str(drafter)]
    out = tmp_path / "r.json"
    argv += ["--prompts", str(prompts), "--max-new-tokens", "4", "--json", str(out)]
    assert eval_cli.main([*argv, "--protocol", "zlab"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "set" in line]
    assert lines and all("(protocol zlab," in line for line in lines)
    data = json.loads(out.read_text())
    assert data["protocol"] == data["summary"]["protocol"] == "zlab"


def test_a_turn_without_verify_steps_has_no_tau_to_average() -> None:
    """A first token that is already EOS ("exact" protocol) is not a tau of 0."""

    def result(tau: float, steps: int) -> eval_cli.PromptResult:
        return eval_cli.PromptResult(0, "s", 1, 1, 3, 1 + int(tau * steps), steps, tau, True, 0, 0)

    summary = eval_cli.summarize([result(3.0, 2), result(0.0, 0), result(1.0, 4)], "s", "exact", 4)
    assert summary.tau == 2.0 and summary.prompts == 3
    assert summary.tau_pooled == (6 + 4) / 6


def _zlab_loop_accept_lengths(
    target: TargetModel, drafter: object, prompt: list[int], max_new: int, stops: list[int]
) -> tuple[list[int], list[int]]:
    """z-lab's `dflash_generate` bookkeeping (@ bb48ef9) written out with this project's
    target and drafter: an output buffer pre-filled with the mask id, `while start <
    max_length`, the stop check on the whole output after every verify step, then the output
    cut at max_length and after the first stop token."""
    import torch

    bsz = drafter.config.block_size  # type: ignore[attr-defined]
    mask_id = drafter.config.mask_token_id  # type: ignore[attr-defined]
    num_in = len(prompt)
    max_length = num_in + max_new
    output = torch.full((1, max_length + bsz), mask_id, dtype=torch.long)
    output[0, :num_in] = torch.tensor(prompt)
    cache = target.new_cache()
    logits, context = target.forward_with_capture(output[:, :num_in], cache=cache)
    output[0, num_in] = logits[0, -1].argmax()
    start, accept = num_in, []
    while start < max_length:
        block = output[:, start : start + bsz].clone()
        positions = torch.arange(start, start + bsz)[None]
        hidden = drafter(context, block, positions)  # type: ignore[operator]
        block[:, 1:] = drafter.logits(hidden[:, 1:]).argmax(-1)  # type: ignore[attr-defined]
        vlogits, vfeats = target.forward_with_capture(block, cache=cache)
        posterior = vlogits.argmax(-1)
        acc = int((block[:, 1:] == posterior[:, :-1]).cumprod(dim=1).sum())
        output[:, start : start + acc + 1] = block[:, : acc + 1]
        output[0, start + acc + 1] = posterior[0, acc]
        accept.append(acc + 1)
        start += acc + 1
        target.crop_cache(cache, start)
        context = torch.cat([context, vfeats[:, : acc + 1]], dim=1)
        if any(s in output[0, num_in:].tolist() for s in stops):
            break
    tokens = output[0, num_in:max_length].tolist()
    tokens = [t for t in tokens if t != mask_id]
    for i, t in enumerate(tokens):
        if t in stops:
            tokens = tokens[: i + 1]
            break
    return tokens, accept


def test_zlab_protocol_matches_zlabs_loop_step_for_step(target: TargetModel) -> None:
    """For every limit from 1 to 24, without and with stop tokens, `protocol="zlab"` gives
    z-lab's tokens and acceptance lengths exactly. The drafter is briefly fitted to the
    target's text so blocks are partly accepted: limits are both hit exactly and overshot."""
    import torch

    prompt = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(11))
    rows = greedy_continuations(target, prompt, 40)
    drafter = make_drafter(target, block_size=4)
    fit(drafter, target, rows, steps=60, lr=1e-2, batch_size=1, num_anchors=32)
    ids = rows[0].ids[:8]
    free = speculative_generate(target, drafter, ids, 40)
    assert len(set(free.accept_lengths)) > 1  # a mix of partial and full blocks
    for stops in ([], [free.tokens[0]], [free.tokens[9]]):
        for limit in range(1, 25):
            want = _zlab_loop_accept_lengths(target, drafter, ids, limit, stops)
            got = speculative_generate(target, drafter, ids, limit, stops, protocol="zlab")
            assert (got.tokens, got.accept_lengths) == want, (stops, limit)
            exact = speculative_generate(target, drafter, ids, limit, stops)
            assert exact.tokens == got.tokens


@pytest.mark.timeout(180)
def test_ctrl_c_reports_the_turns_done_marked_partial(target: TargetModel, tmp_path: Path) -> None:
    """A real `python -m trainer.eval` sent SIGINT mid-run: exit 130 without a traceback, the
    summary of the turns done printed and written as JSON, marked partial."""
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(f"[{5 + i % 20}, {6 + i % 30}, 7]\n" for i in range(2000)))
    drafter = export_drafter(make_drafter(target), tmp_path / "d")
    out = tmp_path / "r.json"
    argv = [sys.executable, "-m", "trainer.eval", "--target", str(target.model.name_or_path)]
    argv += ["--drafter", str(drafter), "--prompts", str(prompts), "--json", str(out)]
    argv += ["--max-new-tokens", "32", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    before: list[str] = []
    while len([x for x in before if x.startswith("prompt ")]) < 3:  # turns are being measured
        line = proc.stdout.readline()
        assert line, proc.communicate()[1]
        before.append(line)
    proc.send_signal(signal.SIGINT)
    rest, err = proc.communicate(timeout=budget.left())
    lines = [*before, *rest.splitlines(keepends=True)]
    done = [x for x in lines if x.startswith("prompt ")]
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert f"interrupted: {len(done)} of 2000 turns done" in err
    summary = [x for x in lines if x.startswith(("set ", "all sets"))]
    assert len(summary) == 2 and all(x.rstrip().endswith("[partial]") for x in summary)
    assert f"prompts={len(done)} " in summary[-1]
    data = json.loads(out.read_text())
    assert data["partial"] is True and data["turns_planned"] == 2000
    assert len(data["prompts"]) == data["summary"]["prompts"] == len(done) >= 3
    assert data["sets"][0]["prompts"] == len(done)
