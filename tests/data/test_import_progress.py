"""`python -m trainer.data import` progress: a live bar (rows, rows/s, ETA) when stderr is a
terminal, none when it is not, and one summary line with rows/s in both cases. Real
subprocesses: one with its stderr on a pseudo-terminal, one on a pipe."""

from __future__ import annotations

import fcntl
import os
import re
import struct
import subprocess
import sys
import termios
from pathlib import Path

from tests import budget
from tests.data.conftest import write_jsonl

REPO = Path(__file__).resolve().parents[2]
ROWS = 300
SUMMARY = re.compile(rf"import: {ROWS} rows read in [\d.]+ s \([\d,]+ rows/s\), {ROWS - 1} kept")


def _argv(tmp_path: Path, tokenizer: Path) -> list[str]:
    chat = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]}
    source = write_jsonl(tmp_path / "c.jsonl", [*[chat] * (ROWS - 1), {"messages": []}])
    return [
        sys.executable,
        "-m",
        "trainer.data",
        "import",
        "--input",
        str(source),
        "--tokenizer",
        str(tokenizer),
        "--max-length",
        "64",
        "--out",
        str(tmp_path / "s"),
        "--workers",
        "1",
    ]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("NO_COLOR", "TERM", "COLUMNS")}
    return {**env, "TERM": "xterm-256color"}


def test_a_terminal_gets_a_progress_bar_and_a_summary(
    tmp_path: Path, qwen_tokenizer_dir: Path
) -> None:
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))
    proc = subprocess.Popen(
        _argv(tmp_path, qwen_tokenizer_dir),
        cwd=REPO,
        env=_env(),
        stdout=subprocess.PIPE,
        stderr=slave,
    )
    os.close(slave)
    chunks = []
    while True:  # until the child's end of the terminal closes
        try:
            data = os.read(master, 65536)
        except OSError:  # EIO: no process holds the terminal any more
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    out, _ = proc.communicate(timeout=budget.left())
    screen = b"".join(chunks).decode(errors="replace")
    assert proc.returncode == 0, screen
    plain = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", screen)
    assert "━" in plain and "100%" in plain  # the bar, over the bytes of the input
    assert f"{ROWS} rows" in plain and "rows/s" in plain and "ETA" in plain
    assert f"{ROWS - 1} kept" in plain
    assert SUMMARY.search(plain), plain
    assert b"rows    " in out  # the store summary still goes to stdout


def test_no_bar_when_stderr_is_not_a_terminal(tmp_path: Path, qwen_tokenizer_dir: Path) -> None:
    done = subprocess.run(
        _argv(tmp_path, qwen_tokenizer_dir),
        cwd=REPO,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )
    assert done.returncode == 0, done.stderr
    assert SUMMARY.fullmatch(done.stderr.strip()), done.stderr
    assert "skipped    1 rows" in done.stdout
