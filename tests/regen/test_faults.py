"""Regeneration through a fault proxy in front of the real vLLM server, and across a SIGKILL.

The reference is an uninterrupted run straight against the server. Through the proxy, rows'
first requests get 429, 500, a hang past the request timeout or a dropped connection, one row
gets 500 on every attempt, and one request makes the proxy act as a restarting server (every
connection cut, the port refusing for a few seconds). Then:

- every input row ends exactly once: in OUT or in the errors file, never both, never twice;
- the always-failing row ends in the errors file after exactly --max-retries + 1 attempts, and
  the job's retries are bounded by the faults injected (plus the requests in flight when the
  "server" restarted);
- the server's going away and coming back are one line each, not a line per request;
- the rows in OUT are the reference's rows (a fault changes when a row is done, not what it is);
- a job SIGKILLed mid-way, its OUT's last line torn as a kill mid-write leaves it, then run again
  with --resume, gives the same OUT as the uninterrupted run, as a set of rows.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from itertools import count
from pathlib import Path
from typing import Any

import pytest

from tests.regen.fault_proxy import FaultProxy, Key
from tests.regen.helpers import read_jsonl, regen_argv, rows_of, run_regen, write_many
from tests.serving.engine import REPO, python_env
from trainer.serving.launch import RunningEngine

pytestmark = [pytest.mark.timeout(1800), pytest.mark.slow]
ROWS = 24
FAILING = 5  # "question 5": HTTP 500 on every attempt
MAX_RETRIES = 3
CONCURRENCY = 3
FIRST_FAULT = {0: "429", 1: "500", 2: "hang", 3: "drop"}  # by row number % 6, first request only
RESTART_AT = 20  # the 20th chat request makes the proxy restart
BUDGET_S = 600.0


def row_number(key: Key) -> int:
    return int(key[0].split()[-1])


@pytest.fixture(scope="module")
def reference(
    regen_server: RunningEngine, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, list[dict[str, Any]]]:
    """The input, and the rows an uninterrupted run straight against the server writes."""
    d = tmp_path_factory.mktemp("reference")
    source = write_many(d / "many.jsonl", ROWS)
    done = run_regen([source], regen_server.url, d / "ref.jsonl", "--reasoning", "disable")
    assert done.returncode == 0, done.stdout + done.stderr
    _, rows = rows_of(d / "ref.jsonl")
    assert len(rows) == ROWS and read_jsonl(d / "ref.errors.jsonl") == []
    return source, rows


def as_set(rows: list[dict[str, Any]]) -> set[str]:
    return {json.dumps(r, sort_keys=True) for r in rows}


def test_faults_end_every_row_exactly_once_with_bounded_retries(
    regen_server: RunningEngine, reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    source, ref_rows = reference
    requests = count(1)

    def plan(key: Key, attempt: int) -> str:
        if next(requests) == RESTART_AT:
            return "restart"
        k = row_number(key)
        if k == FAILING:
            return "500"
        if attempt == 1 and key[1] == 1:
            return FIRST_FAULT.get(k % 6, "pass")
        return "pass"

    out = tmp_path / "out.jsonl"
    with FaultProxy(regen_server.url, plan, restart_s=3.0) as proxy:
        done = run_regen(
            [source], proxy.url, out, "--reasoning", "disable",
            "--max-retries", str(MAX_RETRIES), "--backoff-s", "0.05", "--request-timeout-s", "8",
            "--concurrency", str(CONCURRENCY), "--wait-s", "120",
        )  # fmt: skip
        attempts, faults = Counter(proxy.attempts), Counter(proxy.faults)
    assert done.returncode == 0, done.stdout + done.stderr
    _, rows = rows_of(out)
    errors = read_jsonl(tmp_path / "out.errors.jsonl")

    # every row exactly once, in OUT or in the errors file
    ids = [r["id"] for r in rows] + [e["id"] for e in errors]
    assert sorted(ids) == sorted(r["id"] for r in ref_rows)
    assert len(set(ids)) == len(ids) == ROWS

    # the always-failing row: errors file, after exactly --max-retries + 1 attempts
    failing = next(r for r in ref_rows if r["messages"][0]["content"] == f"question {FAILING}")
    assert [e["id"] for e in errors] == [failing["id"]]
    assert errors[0]["reason"] == "retries_exhausted" and errors[0]["attempts"] == MAX_RETRIES + 1
    # the proxy saw them, but for those that fell in its restart's down time (a refused
    # connection is an attempt of the job's that never reaches the proxy): never more
    assert 1 <= attempts[(f"question {FAILING}", 1)] <= MAX_RETRIES + 1, attempts

    # retries bounded by what was injected (+ the requests the "restart" cut in flight)
    needed = sum(
        len(r["dflash_regen"]["generations"]) for r in ref_rows if r["id"] != failing["id"]
    )
    injected = sum(n for action, n in faults.items() if action != "pass") - MAX_RETRIES - 1
    extra = sum(attempts.values()) - needed - (MAX_RETRIES + 1)
    assert faults["restart"] == 1 and faults["hang"] >= 1 and faults["drop"] >= 1
    assert injected <= extra <= injected + 2 * CONCURRENCY, (attempts, faults)
    assert max(n for key, n in attempts.items() if row_number(key) != FAILING) <= 1 + MAX_RETRIES

    # the server's restart: one line going away, one coming back
    assert done.stdout.count("Regen server: ") == 2, done.stdout
    assert " down (" in done.stdout and " up again after " in done.stdout

    # what was written is what the uninterrupted run wrote
    assert as_set(rows) == as_set([r for r in ref_rows if r["id"] != failing["id"]])


def test_sigkill_then_resume_gives_the_uninterrupted_rows(
    regen_server: RunningEngine, reference: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    source, ref_rows = reference
    out = tmp_path / "out.jsonl"
    with FaultProxy(regen_server.url, lambda key, attempt: "pass", delay_s=0.4) as proxy:
        argv = regen_argv([source], proxy.url, out, "--reasoning", "disable", "--concurrency", "2")
        job = subprocess.Popen(
            argv, cwd=REPO, env=python_env(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        deadline = time.monotonic() + BUDGET_S
        while len(read_jsonl(out)) < 1 + 6:  # the manifest and 6 rows
            assert job.poll() is None, job.stderr.read() if job.stderr else ""
            assert time.monotonic() < deadline, "no 6 rows within the budget"
            time.sleep(0.1)
        os.kill(job.pid, signal.SIGKILL)
        job.wait()
    killed = rows_of(out)[1]
    assert 6 <= len(killed) < ROWS
    torn = json.dumps(ref_rows[-1])[:50]  # a kill mid-write: half a line, no newline
    with out.open("a") as fh:
        fh.write(torn)

    done = run_regen([source], regen_server.url, out, "--reasoning", "disable", "--resume")
    assert done.returncode == 0, done.stdout + done.stderr
    assert (
        f"{ROWS - len(killed)} rows to regenerate of {ROWS} ({len(killed)} ended before)"
        in done.stdout
    )
    assert "was cut short (a kill mid-write)" in done.stdout
    _, rows = rows_of(out)
    assert len(rows) == len({r["id"] for r in rows}) == ROWS
    assert as_set(rows) == as_set(ref_rows)
    assert read_jsonl(tmp_path / "out.errors.jsonl") == []
