"""`python -m trainer.data`: exit codes, one-line errors, summaries, and real interruption."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests import budget
from tests.data.conftest import write_jsonl
from trainer.data.cli import main
from trainer.data.store import TokenStore

REPO = Path(__file__).resolve().parents[2]
SYNTH = [sys.executable, "-m", "trainer.data", "synth"]


def _npy(tmp_path: Path) -> Path:
    path = tmp_path / "lengths.npy"
    np.save(path, np.array([10, 20, 30, 40], dtype=np.int64))
    return path


def test_synth_then_info(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    argv = ["synth", "--lengths-from", str(_npy(tmp_path)), "--vocab", "64", "--out", str(out)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "rows       4  tokens 100" in printed
    assert "never emitted: 56..63  mask token 63" in printed
    assert main(["info", str(out), "--verify"]) == 0
    assert "verify     ok" in capsys.readouterr().out
    assert main(["info", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["num_tokens"] == 100


def test_existing_store_is_refused_then_forced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    base = ["synth", "--lengths-from", str(_npy(tmp_path)), "--vocab", "64", "--out", str(out)]
    assert main(base) == 0
    first = TokenStore.open(out).manifest.files["tokens.i32"].sha256
    capsys.readouterr()
    assert main([*base, "--seed", "9"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{out}: already exists" in err
    assert TokenStore.open(out).manifest.files["tokens.i32"].sha256 == first
    assert main([*base, "--seed", "9", "--force"]) == 0
    assert TokenStore.open(out).manifest.files["tokens.i32"].sha256 != first


def test_import_prints_reasons_with_lines(
    tmp_path: Path, qwen_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chat = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello world"},
        ]
    }
    source = write_jsonl(tmp_path / "c.jsonl", [chat, b"{bad", chat, b"\xff\xfe"])
    out = tmp_path / "s"
    argv = ["import", "--input", str(source), "--tokenizer", str(qwen_tokenizer_dir)]
    assert main([*argv, "--max-length", "64", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "rows       2" in printed
    assert "malformed_json" in printed and "(lines 2)" in printed
    assert "not_utf8" in printed and "(lines 4)" in printed


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--input", "{missing}"], "missing.jsonl: input file not found"),
        (["--template-kwargs", "[1]"], "--template-kwargs: must be a JSON object"),
        (["--template-kwargs", "{nope"], "--template-kwargs: not JSON"),
        (["--max-length", "1"], "--max-length 1: must be at least 2"),
    ],
)
def test_import_input_errors_exit_2_with_one_line(
    tmp_path: Path,
    qwen_tokenizer_dir: Path,
    capsys: pytest.CaptureFixture[str],
    extra: list[str],
    message: str,
) -> None:
    source = write_jsonl(tmp_path / "c.jsonl", [{"messages": []}])
    args = {
        "--input": str(source),
        "--tokenizer": str(qwen_tokenizer_dir),
        "--max-length": "64",
        "--out": str(tmp_path / "s"),
    }
    for key, value in zip(extra[::2], extra[1::2], strict=True):
        args[key] = value.replace("{missing}", str(tmp_path / "missing.jsonl"))
    argv = ["import"] + [part for kv in args.items() for part in kv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err
    assert not (tmp_path / "s").exists()


def test_info_on_damaged_store_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    main(["synth", "--lengths-from", str(_npy(tmp_path)), "--vocab", "64", "--out", str(out)])
    (out / "mask.u8").write_bytes(b"\0")
    capsys.readouterr()
    assert main(["info", str(out)]) == 2
    assert "mask.u8: 1 bytes, manifest says 100" in capsys.readouterr().err


def test_module_entry_point_runs(tmp_path: Path) -> None:
    out = tmp_path / "s"
    cmd = [sys.executable, "-m", "trainer.data", "synth", "--lengths-from", str(_npy(tmp_path))]
    done = subprocess.run(
        [*cmd, "--vocab", "64", "--out", str(out)], cwd=REPO, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "trainer.data", "synth", "--vocab", "64"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "--lengths-from" in bad.stderr


@pytest.mark.timeout(60)
def test_sigterm_mid_write_leaves_no_store_and_no_temp(tmp_path: Path) -> None:
    lengths = tmp_path / "big.npy"
    np.save(lengths, np.full(200_000, 4096, dtype=np.int64))  # ~800M tokens: minutes of work
    out = tmp_path / "s"
    proc = subprocess.Popen(
        [*SYNTH, "--lengths-from", str(lengths), "--vocab", "512", "--out", str(out)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        temp = None
        while temp is None and proc.poll() is None:  # wait until rows are being written
            temps = [p for p in tmp_path.glob(".s.tmp-*") if (p / "tokens.i32").exists()]
            if temps and (temps[0] / "tokens.i32").stat().st_size > 0:
                temp = temps[0]
            time.sleep(0.05)
        assert temp is not None, proc.communicate()
        os.kill(proc.pid, signal.SIGTERM)
        _, err = proc.communicate(timeout=budget.left())
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "nothing was written" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.npy"]


def test_progress_goes_to_stderr(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("trainer.data.cli.PROGRESS_EVERY_S", 0.0)
    argv = ["synth", "--lengths-from", str(_npy(tmp_path)), "--vocab", "64"]
    assert main([*argv, "--out", str(tmp_path / "s")]) == 0
    captured = capsys.readouterr()
    assert "synth: 4 rows of 4" in captured.err and "synth:" not in captured.out


def test_show_marks_supervised_text(
    tmp_path: Path, qwen_tokenizer_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    chat = {
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello world"},
        ]
    }
    source = write_jsonl(tmp_path / "c.jsonl", [chat])
    out = tmp_path / "s"
    argv = ["import", "--input", str(source), "--tokenizer", str(qwen_tokenizer_dir)]
    assert main([*argv, "--max-length", "64", "--out", str(out), "--workers", "1"]) == 0
    capsys.readouterr()
    assert main(["show", str(out)]) == 0  # tokenizer found through the manifest
    shown = capsys.readouterr().out
    assert (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n⟦hello world<|im_end|>⟧\n" in shown
    )
    assert main(["show", str(out), "--rows", "1"]) == 2
    assert "--rows: 1 is outside 0..0" in capsys.readouterr().err


def test_show_synthetic_prints_ids(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "s"
    main(["synth", "--lengths-from", str(_npy(tmp_path)), "--vocab", "64", "--out", str(out)])
    capsys.readouterr()
    assert main(["show", str(out), "--rows", "0"]) == 0
    shown = capsys.readouterr().out
    store = TokenStore.open(out)
    tokens, mask = store.row(0)
    first = int(np.argmax(mask))
    expected = " ".join(map(str, tokens[:first])) + " ⟦" + " ".join(map(str, tokens[first:])) + " ⟧"
    assert f"--- row 0: 10 tokens, {10 - first} supervised\n{expected}\n" in shown


def test_synth_and_info_need_neither_torch_nor_transformers(tmp_path: Path) -> None:
    lengths = _npy(tmp_path)
    code = (
        "import sys\n"
        "sys.modules['torch'] = None\n"
        "sys.modules['transformers'] = None\n"
        "from trainer.data.cli import main\n"
        f"assert main(['synth', '--lengths-from', {str(lengths)!r}, '--vocab', '64',"
        f" '--out', {str(tmp_path / 's')!r}]) == 0\n"
        f"assert main(['info', {str(tmp_path / 's')!r}, '--verify']) == 0\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
