"""The serving engines of a job: per-server concurrency, the least-loaded choice, and a server
that went away waited for.

Each server takes at most `concurrency` requests at a time. `acquire` hands out the up server
with the fewest requests in flight (ties: the one the row used last, so a conversation's next
turn can reuse its prefix cache; then `--server` order) and waits while every up server is
full. A request that cannot connect marks its server down (`mark_down`): no request goes there
until a probe of `/v1/models` (every `probe_s`) answers again. Each change of a server's state
is one line (`say`): "down (why): waiting", "up again after 42 s" - not a line per request.
When every server is down, `all_down_s` says for how long (the job gives up after `--wait-s`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

PROBE_S = 2.0


@dataclass
class Server:
    url: str
    limit: int
    in_flight: int = 0
    up: bool = True
    down_since: float | None = None
    reason: str = ""
    requests: int = 0  # requests sent to it this job
    probe: asyncio.Task[None] | None = field(default=None, repr=False)


class ServerPool:
    """The job's servers (see the module docstring). `check(url)` probes one (raises when it
    does not answer); `say(line)` prints a state change."""

    def __init__(
        self,
        urls: list[str],
        concurrency: int,
        check: Callable[[str], Awaitable[object]],
        say: Callable[[str], None],
        probe_s: float = PROBE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.servers = [Server(url, concurrency) for url in urls]
        self._check, self._say, self._probe_s, self._clock = check, say, probe_s, clock
        self._changed = asyncio.Condition()
        self._all_down_since: float | None = None

    def in_flight(self) -> list[int]:
        return [s.in_flight for s in self.servers]

    def down(self) -> list[Server]:
        return [s for s in self.servers if not s.up]

    def all_down_s(self) -> float:
        """Seconds every server has been down (0 while one is up)."""
        since = self._all_down_since
        return 0.0 if since is None else self._clock() - since

    def _pick(self, prefer: Server | None) -> Server | None:
        free = [s for s in self.servers if s.up and s.in_flight < s.limit]
        if not free:
            return None
        low = min(s.in_flight for s in free)
        if prefer is not None and prefer in free and prefer.in_flight == low:
            return prefer
        return next(s for s in free if s.in_flight == low)

    async def acquire(self, prefer: Server | None = None) -> Server:
        """A slot on the least-loaded up server (waits for one)."""
        async with self._changed:
            while (server := self._pick(prefer)) is None:
                await self._changed.wait()
            server.in_flight += 1
            server.requests += 1
            return server

    async def release(self, server: Server) -> None:
        async with self._changed:
            server.in_flight -= 1
            self._changed.notify_all()

    async def mark_down(self, server: Server, reason: str) -> None:
        """`server` stopped answering: no more requests there until a probe answers."""
        async with self._changed:
            if not server.up:
                return
            server.up, server.down_since, server.reason = False, self._clock(), reason
            if not any(s.up for s in self.servers):
                self._all_down_since = self._clock()
            up = sum(s.up for s in self.servers)
            self._say(
                f"{server.url} down ({reason}); waiting for it, probing every {self._probe_s:g} s "
                f"({up} of {len(self.servers)} servers up)"
            )
            server.probe = asyncio.get_running_loop().create_task(self._wait_up(server))

    async def _wait_up(self, server: Server) -> None:
        while True:
            await asyncio.sleep(self._probe_s)
            try:
                await self._check(server.url)
            except Exception:  # any failure: still down (its reason stays the first one)
                continue
            break
        async with self._changed:
            gone = self._clock() - (server.down_since or self._clock())
            server.up, server.down_since, server.probe = True, None, None
            self._all_down_since = None
            self._changed.notify_all()
            self._say(f"{server.url} up again after {gone:.0f} s")

    def close(self) -> None:
        for server in self.servers:
            if server.probe is not None:
                server.probe.cancel()
