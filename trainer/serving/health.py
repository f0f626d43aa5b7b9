"""`python -m trainer.serving.health --url URL --timeout-s S [--pid PID] [--log FILE]`: wait for
an engine's health endpoint (what `dflashctl regen --serve` runs before the job).

Exit 0 once GET URL/health answers 200; 1 when `--timeout-s` passed or the engine process
(`--pid`) exited first, with one line naming the URL and the log's last line. A refused
connection is "not yet": an engine takes minutes to load a model.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from trainer.errors import ExitCode
from trainer.serving.client import EngineClient
from trainer.serving.launch import last_line

POLL_S = 1.0


def alive(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def wait(url: str, timeout_s: float, pid: int | None, log: Path | None) -> str | None:
    """None once URL/health answers; else why not (one line)."""
    deadline = time.monotonic() + timeout_s
    with EngineClient(url) as client:
        while not client.healthy():
            if pid is not None and not alive(pid):
                where = f"; {log}: {last_line(log)}" if log is not None else ""
                return f"the engine (pid {pid}) exited before {url}/health answered{where}"
            if time.monotonic() > deadline:
                where = f"; {log}: {last_line(log)}" if log is not None else ""
                return f"{url}/health did not answer within {timeout_s:g} s{where}"
            time.sleep(POLL_S)
    return None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer.serving.health", description=__doc__.split("\n")[0]
    )
    p.add_argument("--url", required=True, help="the engine, e.g. http://127.0.0.1:8000")
    p.add_argument("--timeout-s", type=float, default=1800.0)
    p.add_argument("--pid", type=int, help="the engine's process: its exit ends the wait")
    p.add_argument("--log", type=Path, help="the engine's log (its last line is reported)")
    args = p.parse_args(argv)
    started = time.monotonic()
    problem = wait(args.url.rstrip("/"), args.timeout_s, args.pid, args.log)
    if problem is not None:
        print(f"ERROR: {problem}", flush=True)
        return ExitCode.FAILED
    print(f"{args.url} is up after {time.monotonic() - started:.0f} s", flush=True)
    return ExitCode.OK


if __name__ == "__main__":
    sys.exit(main())
