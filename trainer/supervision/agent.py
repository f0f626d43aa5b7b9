"""torchrun's own account of its worker group, read from the agent's stderr on a group node.

The node's supervisor runs torchrun (the elastic agent) with its stderr piped through `AgentTee`,
which copies every byte on to the pane and turns the agent's log lines into events: a worker
that failed (its local rank, exit code and pid: the one record of a rank killed by a signal),
a worker-group restart torchrun starts (a failure, or another node rejoining), the rendezvous
it enters and completes (with its c10d group rank), and a rendezvous error that ends the agent.
The agent logs those at INFO, so the supervisor runs it with LOGLEVEL=INFO; the lines are
torch 2.13's (`torch.distributed.elastic.agent.server.api`, `.multiprocessing.api`), pinned by
the tests that run the real torchrun.
"""

from __future__ import annotations

import queue
import re
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import IO

from trainer.supervision.statefile import now_iso

_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+) \(pid: (\d+)\)")
_RESTART = re.compile(r"Worker group (FAILED|UNHEALTHY)\. (\d+)/(\d+) attempts left")
_JOINED = re.compile(r"Detected (\d+) new nodes from group_rank=(\d+); will restart")
_ENTER = "Rendezvous'ing worker group"
_DONE = "Rendezvous complete for workers"
# the result's lines carry the log prefix too: `I1205 15:10:52.253000 14417 .../api.py:553]   group_rank=0`
_RESULT_LINE = re.compile(r"^(?:\S.*\])?\s{2,}(\w+)=(.*)$")
_RDZV_ERROR = re.compile(r"\b(Rendezvous(?:Timeout|Closed|Connection|State)?Error)\b:?\s*(.*)")
_EXHAUSTED = "ChildFailedError"

RDZV_KINDS = {
    "RendezvousTimeoutError": "timeout",
    "RendezvousClosedError": "closed",
    "RendezvousConnectionError": "connection",
    "RendezvousStateError": "state",
    "RendezvousError": "error",
}


@dataclass(frozen=True)
class AgentEvent:
    at: float = field(default_factory=time.monotonic, compare=False)
    wall: str = field(default_factory=now_iso, compare=False)


@dataclass(frozen=True)
class WorkerFailed(AgentEvent):
    """A worker of this node exited non-zero (torchrun logs the first one per failure)."""

    exitcode: int = 0  # Popen's: negative = killed by that signal
    local_rank: int = 0
    pid: int = 0


@dataclass(frozen=True)
class Restarting(AgentEvent):
    """torchrun stops its workers to form a new worker group (a new rendezvous round)."""

    why: str = ""  # "workers failed" | "another node joined"


@dataclass(frozen=True)
class Rendezvousing(AgentEvent):
    """The agent entered a rendezvous round (it waits for every node)."""


@dataclass(frozen=True)
class RendezvousDone(AgentEvent):
    """Every node joined; the workers start. `group_rank` is c10d's, not the inventory's."""

    group_rank: int | None = None


@dataclass(frozen=True)
class RendezvousFailed(AgentEvent):
    """A rendezvous error the agent dies of: timeout, closed, connection, state, error."""

    kind: str = "error"
    text: str = ""


@dataclass(frozen=True)
class Exhausted(AgentEvent):
    """torchrun spent its --max-restarts and reports its workers failed (ChildFailedError)."""


class AgentLog:
    """Parses the agent's lines one at a time (the rendezvous result spans several)."""

    def __init__(self) -> None:
        self._in_result = False

    def parse(self, line: str) -> AgentEvent | None:
        if self._in_result:
            m = _RESULT_LINE.match(line)
            if m is None:
                self._in_result = False  # the result ended without a group rank
                return RendezvousDone()
            if m.group(1) == "group_rank" and m.group(2).strip().isdigit():
                self._in_result = False
                return RendezvousDone(group_rank=int(m.group(2)))
            return None
        if (m := _FAILED.search(line)) is not None:
            return WorkerFailed(
                exitcode=int(m.group(1)), local_rank=int(m.group(2)), pid=int(m.group(3))
            )
        if _RESTART.search(line):
            return Restarting(why="workers failed")
        if _JOINED.search(line):
            return Restarting(why="another node joined")
        if _ENTER in line:
            return Rendezvousing()
        if _DONE in line:
            self._in_result = True
            return None
        if (m := _RDZV_ERROR.search(line)) is not None and "raise" not in line:
            return RendezvousFailed(kind=RDZV_KINDS[m.group(1)], text=line.strip())
        if _EXHAUSTED in line and "raise" not in line:
            return Exhausted()
        return None


TAIL_LINES = 30


def error_line(lines: list[str]) -> str | None:
    """The agent's own account of why it ended: its last exception line (`...Error: ...`),
    else its last line."""
    for line in reversed(lines):
        if re.search(r"\b\w*(Error|Exception)\b:", line) and "raise" not in line:
            return line[:500]
    return lines[-1][:500] if lines else None


class AgentTee:
    """Copies the agent's stderr to `out` (the pane) and queues its events, in a thread."""

    def __init__(self, source: IO[bytes], out: IO[bytes]) -> None:
        self.events: queue.Queue[AgentEvent] = queue.Queue()
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)  # its last lines that say something
        self._source, self._out = source, out
        self._log = AgentLog()
        self._thread = threading.Thread(target=self._pump, name="agent-tee", daemon=True)
        self._thread.start()

    def _pump(self) -> None:
        for raw in iter(self._source.readline, b""):
            try:
                self._out.write(raw)
                self._out.flush()
            except (OSError, ValueError):  # the pane went away: keep reading, keep parsing
                pass
            line = raw.decode("utf-8", "replace").rstrip("\n")
            if line.strip():
                self.tail.append(line.strip())
            event = self._log.parse(line)
            if event is not None:
                self.events.put(event)

    def drain(self) -> list[AgentEvent]:
        """The events parsed since the last call, oldest first."""
        out: list[AgentEvent] = []
        while True:
            try:
                out.append(self.events.get_nowait())
            except queue.Empty:
                return out

    def join(self, timeout: float) -> None:
        """Wait for the agent's stderr to close (every line read) up to `timeout`."""
        self._thread.join(timeout)
