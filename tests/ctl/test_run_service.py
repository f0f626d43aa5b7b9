"""`RunService`: the protocol the monitor, TUI and doubles use; `RunControl` implements it.
`tail_log` and `log_line_count` over LocalTransport (a real `tail -F` of a real file)."""

from __future__ import annotations

import asyncio
import inspect
import sys
from pathlib import Path

from dflashctl.config.inventory import local_host
from dflashctl.remote import LocalTransport
from dflashctl.runs.control import RunControl
from dflashctl.runs.service import RunService
from tests import budget

PROTOCOL_METHODS = (
    "status",
    "deployed_config",
    "checkpoint_config",
    "gpus",
    "start",
    "stop",
    "restart",
    "tail_log",
    "log_line_count",
    "follow",
)


def test_run_control_has_every_protocol_method_with_its_signature() -> None:
    service: RunService = RunControl(
        LocalTransport(), local_host("h", Path("/nonexistent"), python=sys.executable)
    )
    for name in PROTOCOL_METHODS:
        want = inspect.signature(getattr(RunService, name)).parameters
        got = inspect.signature(getattr(RunControl, name)).parameters
        assert [str(p) for p in got.values()] == [str(p) for p in want.values()], name
        assert callable(getattr(service, name))


async def test_tail_log_is_one_stream_from_a_line_and_counts_lines(tmp_path: Path) -> None:
    host = local_host("h", tmp_path / "wd", python=sys.executable)
    (tmp_path / "wd" / "run").mkdir(parents=True)
    log = tmp_path / "wd" / "run" / "status.log"
    transport = LocalTransport()
    ctl = RunControl(transport, host)
    try:
        assert await ctl.log_line_count() == 0  # no file yet: an empty log
        log.write_text("a\nb\x1b[31m\nc\n")
        assert await ctl.log_line_count() == 3
        got: list[str] = []

        async def read() -> None:
            async for line in ctl.tail_log(1):
                got.append(line)
                if len(got) == 3:
                    return

        task = asyncio.create_task(read())
        await asyncio.sleep(0.3)
        with log.open("a") as fh:
            fh.write("d\npartial")
        await asyncio.wait_for(task, budget.left())
        assert got[0].startswith("b") and "\x1b" not in got[0]  # sanitised where it enters
        assert [got[1], got[2]] == ["c", "d"]
    finally:
        await transport.close()
