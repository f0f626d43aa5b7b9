"""`--help` and input errors answer before torch or transformers load (importing transformers
takes 10-40 s on a loaded machine). A small harness runs each command as `python -m` would, in
a fresh interpreter, and reports its exit status and which heavy modules were imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests import budget

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers")
HARNESS = """
import json, runpy, sys
module, *sys.argv[1:] = sys.argv[1:]
sys.argv[0] = module
try:
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    code = 0
except SystemExit as exc:
    code = exc.code
heavy = [m for m in {heavy!r} if m in sys.modules]
print(json.dumps({{"code": code, "heavy": heavy}}), file=sys.stderr)
"""


def _probe(*argv: str) -> tuple[int, list[str], str]:
    """(exit status, heavy modules imported, what the command wrote to stderr)."""
    done = subprocess.run(
        [sys.executable, "-c", HARNESS.format(heavy=HEAVY), *argv],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )
    *said, report = done.stderr.strip().splitlines()
    result = json.loads(report)
    return result["code"], result["heavy"], "\n".join(said)


@pytest.mark.parametrize(
    "module",
    [
        "trainer.eval",
        "trainer.gate",
        "trainer.data",
        "trainer.export",
        "trainer.buckets",
        "trainer.doctor",
        "trainer.regen",
    ],
)
def test_help_loads_neither_torch_nor_transformers(module: str) -> None:
    code, heavy, _ = _probe(module, "--help")
    assert (code, heavy) == (0, [])


def _eval_inputs(tmp_path: Path) -> tuple[Path, Path, Path]:
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"vocab_size": 100}))
    drafter = tmp_path / "drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("[1, 2]\n")
    return target, drafter, prompts


def test_eval_input_errors_come_before_the_heavy_imports(tmp_path: Path) -> None:
    target, drafter, prompts = _eval_inputs(tmp_path)
    bad_prompts = tmp_path / "bad.jsonl"
    bad_prompts.write_text('[1, 2]\n{"turns": "oops"\n')
    base = ["--target", str(target), "--drafter", str(drafter), "--prompts"]
    cases = [
        ([*base, str(bad_prompts)], f"{bad_prompts}:2: invalid JSON"),
        ([*base, str(tmp_path / "missing.jsonl")], "missing.jsonl"),
        ([*base, str(prompts), "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        ([*base, str(prompts), "--template-kwargs", "[1]"], "--template-kwargs"),
        ([*base, str(prompts), "--eos-id", "100"], "--eos-id 100 is outside"),
        (
            ["--target", str(target), "--drafter", str(tmp_path), "--prompts", str(prompts)],
            "not a drafter export",
        ),
        (
            ["--target", str(tmp_path), "--drafter", str(drafter), "--prompts", str(prompts)],
            "not a model directory",
        ),
    ]
    for argv, message in cases:
        code, heavy, err = _probe("trainer.eval", *argv)
        assert (code, heavy) == (2, []), (argv, err)
        assert message in err and err.startswith("error: ") and err.count("\n") == 0, err


def test_an_engine_we_cannot_check_is_refused_by_name_with_the_reason(tmp_path: Path) -> None:
    """SGLang cannot run here (docs/serving.md): `--engine sglang` says so in one line, exit 2,
    before anything loads; an unknown name lists the engines; `vllm` (any case) is taken."""
    target, drafter, prompts = _eval_inputs(tmp_path)
    base = ["--target", str(target), "--drafter", str(drafter), "--prompts", str(prompts)]
    for module, argv in (("trainer.eval", base), ("trainer.gate", ["--config", "x.toml"])):
        for engine, message in (
            ("sglang", "argument --engine: sglang: SGLang is not supported: its DFlash worker"),
            ("SGLang", "SGLang: SGLang is not supported"),
            ("tgi", "argument --engine: 'tgi': one of vllm"),
        ):
            code, heavy, err = _probe(module, *argv, "--engine", engine)
            assert (code, heavy) == (2, []), (module, engine, err)
            assert message in err.splitlines()[-1] and err.count("error:") == 1, err
    # negative control: the engine we can check passes argparse and fails later, on its own
    # missing --server/--serve-cmd
    code, _, err = _probe("trainer.eval", *base, "--engine", "VLLM")
    assert (code, err) == (
        2,
        "error: --engine needs exactly one of --server URL or --serve-cmd CMD",
    )


def test_data_import_input_errors_come_before_the_heavy_imports(tmp_path: Path) -> None:
    source = tmp_path / "c.jsonl"
    source.write_text('{"messages": []}\n')
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "x").write_text("")
    base = ["import", "--max-length", "64", "--out", str(tmp_path / "s")]
    good = ["--input", str(source), "--tokenizer", str(tokenizer)]
    cases = [
        ([*base, "--input", str(tmp_path / "none.jsonl"), "--tokenizer", str(tokenizer)], "none"),
        ([*base, "--input", str(source), "--tokenizer", str(tmp_path / "no-tok")], "no-tok"),
        ([*base, *good, "--template-kwargs", "{oops"], "--template-kwargs: not JSON"),
        ([*base, *good, "--chat-template", str(tmp_path / "t.jinja")], "t.jinja"),
        (["import", *good, "--max-length", "1", "--out", str(tmp_path / "s")], "--max-length 1"),
        (["import", *good, "--max-length", "64", "--out", str(taken)], str(taken)),
    ]
    for argv, message in cases:
        code, heavy, err = _probe("trainer.data", *argv)
        assert (code, heavy) == (2, []), (argv, err)
        assert message in err and err.count("\n") == 0, err


def test_regen_and_a_regenerated_imports_errors_come_before_the_heavy_imports(
    tmp_path: Path,
) -> None:
    """trainer.regen's flags are checked before anything connects; an import whose
    --template-kwargs contradict a regenerated file's mode is refused before the tokenizer."""
    from trainer.data.served import RegenManifest

    source = tmp_path / "c.jsonl"
    source.write_text('{"messages": [{"role": "user", "content": "q"}]}\n')
    base = ["--input", str(source), "--out", str(tmp_path / "o.jsonl")]
    for argv, message in (
        ([*base, "--server", "localhost:8000"], "--server 'localhost:8000': not an http(s)"),
        ([*base, "--server", "http://h:1", "--concurrency", "0"], "--concurrency 0: must be >= 1"),
        ([*base, "--server", "http://h:1", "--sampling", '{"model": "x"}'], "--sampling: model"),
        (
            [*base, "--server", "http://h:1", "--reasoning", "save", "--template-kwargs",
             '{"enable_thinking": false}'],
            "contradicts --reasoning save",
        ),
    ):  # fmt: skip
        code, heavy, err = _probe("trainer.regen", *argv)
        assert (code, heavy) == (2, []), (argv, err)
        assert message in err and err.startswith("error: ") and err.count("\n") == 0, err
    manifest = RegenManifest(
        model="m", reasoning="save", chat_template_kwargs={"enable_thinking": True},
        temperature=0.0, max_tokens=8,
    )  # fmt: skip
    regen = tmp_path / "regen.jsonl"
    regen.write_text(manifest.line() + "\n")
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    argv = ["import", "--input", str(regen), "--tokenizer", str(tokenizer), "--max-length", "64"]
    argv += ["--out", str(tmp_path / "s"), "--template-kwargs", '{"enable_thinking": false}']
    code, heavy, err = _probe("trainer.data", *argv)
    assert (code, heavy) == (2, []), err
    assert "'enable_thinking' is false but the rows were generated with true" in err


def test_doctor_config_errors_come_before_the_heavy_imports(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[model]\ntarget_dir = "t"\nmask_token_id = "x"\n')
    for argv, message in (
        (["--config", str(tmp_path / "none.toml")], "none.toml: no such config file"),
        (["--config", str(bad)], "model.mask_token_id"),
    ):
        code, heavy, err = _probe("trainer.doctor", *argv)
        assert (code, heavy) == (2, []), (argv, err)
        assert message in err and err.startswith("error: ") and err.count("\n") == 0, err


def test_gate_usage_errors_come_before_the_heavy_imports(tmp_path: Path) -> None:
    missing = tmp_path / "run.toml"
    code, heavy, said = _probe("trainer.gate", "--config", str(missing))
    assert (code, heavy, said) == (2, [], f"error: --config {missing}: no such file")
    missing.write_text("")
    code, heavy, said = _probe("trainer.gate", "--config", str(missing), "--engine", "vllm")
    assert (code, heavy) == (2, [])
    assert said == "error: --engine needs exactly one of --server URL or --serve-cmd CMD"
