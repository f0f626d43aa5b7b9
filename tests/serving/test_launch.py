"""Starting and stopping an engine process, with real subprocesses standing in for one that
dies at start, one that never answers, and one that answers and leaves a worker behind."""

from __future__ import annotations

import json
import sys
import textwrap
import time
from pathlib import Path

import pytest

from trainer.serving.errors import EngineError
from trainer.serving.launch import free_port, served_engine, vllm_serve_argv


def alive(pid: int, budget_s: float = 60.0) -> bool:
    """Whether `pid` still runs after waiting (one budget) for it to end: gone, or a zombie
    that nobody reaped yet (its parent died with it; this container's init may not reap)."""
    deadline = time.monotonic() + budget_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return False
        if state in ("Z", "X"):
            return False
        time.sleep(0.1)
    return True


def test_serve_argv_appends_the_run_and_keeps_the_users_flags_last() -> None:
    argv = vllm_serve_argv(
        ["vllm", "serve"],
        target=Path("/m/t"),
        drafter=Path("/m/d"),
        block_size=16,
        port=8123,
        dtype="bfloat16",
        extra=["--max-model-len", "4096"],
    )
    assert argv[:8] == ["vllm", "serve", "--model", "/m/t", "--host", "127.0.0.1", "--port", "8123"]
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "dflash", "model": "/m/d", "num_speculative_tokens": 15}
    assert argv[argv.index("--dtype") + 1] == "bfloat16"
    assert argv[-2:] == ["--max-model-len", "4096"]


def test_an_engine_that_dies_at_start_is_one_line_with_its_last_words(tmp_path: Path) -> None:
    argv = [
        sys.executable,
        "-c",
        "print('loading...'); print('ValueError: no such model'); raise SystemExit(3)",
    ]
    port = free_port()
    with (
        pytest.raises(EngineError) as err,
        served_engine(argv, port=port, log=tmp_path / "e.log", timeout_s=600),
    ):
        pass
    text = str(err.value)
    assert f"status 3 before http://127.0.0.1:{port}/health" in text
    assert f"{tmp_path / 'e.log'}: ValueError: no such model" in text
    assert "\n" not in text


def test_an_engine_that_never_answers_is_stopped_after_the_budget(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    script = (
        f"import os, time; open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep(600)"
    )
    port = free_port()
    with (
        pytest.raises(
            EngineError, match=rf"http://127.0.0.1:{port}/health did not answer within 3 s"
        ),
        served_engine(
            [sys.executable, "-c", script], port=port, log=tmp_path / "e.log", timeout_s=3
        ),
    ):
        pass
    assert not alive(int(pid_file.read_text()))


SERVER = textwrap.dedent(
    """
    import http.server, subprocess, sys
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    open(sys.argv[2], "w").write(str(child.pid))
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
    """
)


def test_leaving_stops_the_engine_and_the_workers_it_started(tmp_path: Path) -> None:
    """An engine's workers (vLLM's engine core) die with it: the whole session is signalled."""
    port = free_port()
    child = tmp_path / "child.pid"
    argv = [sys.executable, "-c", SERVER, str(port), str(child)]
    with served_engine(argv, port=port, log=tmp_path / "e.log", timeout_s=600) as engine:
        assert engine.url == f"http://127.0.0.1:{port}"
        assert engine.process.poll() is None
    assert engine.process.poll() is not None
    assert not alive(int(child.read_text()))
