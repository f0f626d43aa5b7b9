"""A small local HTTP proxy in front of a real server that injects faults into chat requests.

Each chat request is keyed by its row and turn (the first user message's text and the number
of messages) and counted; `plan(key, attempt)` decides what that attempt gets:

* `pass`: forwarded to the real server, its answer returned (after `delay_s`);
* `429` / `500`: that status with a JSON error body (the server is not asked);
* `hang`: no answer at all until the client gives up (its request timeout);
* `drop`: the connection is cut (RST) right after the request is read;
* `restart`: as a server restart looks from outside: the request's connection and every other
  open one are cut, the port refuses connections for `restart_s`, then it listens again.

`hold()` makes every chat request wait, unanswered, until `release()` (a job that cannot end
before the test has done what it must do while the job runs).

Everything else (GET /v1/models: the client's probes) is forwarded while the proxy listens.
It runs its own event loop in a thread, so the process under test is a real separate client.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
from collections import Counter
from collections.abc import Callable
from typing import Any

import httpx

Key = tuple[str, int]
Plan = Callable[[Key, int], str]
REASONS = {200: "OK", 429: "Too Many Requests", 500: "Internal Server Error"}


def request_key(body: bytes) -> Key | None:
    """(first user message text, number of messages) of a chat request; None for others."""
    try:
        data = json.loads(body)
        messages = data["messages"]
        first = next(m["content"] for m in messages if m["role"] == "user")
    except (ValueError, KeyError, TypeError, StopIteration):
        return None
    return str(first), len(messages)


class FaultProxy:
    def __init__(
        self, upstream: str, plan: Plan, *, restart_s: float = 3.0, delay_s: float = 0.0
    ) -> None:
        self.upstream, self.plan, self.restart_s, self.delay_s = upstream, plan, restart_s, delay_s
        self.attempts: Counter[Key] = Counter()
        self.faults: Counter[str] = Counter()
        self.port = 0
        self.loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._http: httpx.AsyncClient | None = None
        self._open = asyncio.Event()
        self._open.set()

    def hold(self) -> None:
        """From now, chat requests wait (unanswered, not forwarded) until `release()`."""
        self.loop.call_soon_threadsafe(self._open.clear)

    def release(self) -> None:
        self.loop.call_soon_threadsafe(self._open.set)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the fault proxy did not start")
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._http = httpx.AsyncClient(base_url=self.upstream, timeout=600.0, trust_env=False)
        self.loop.run_until_complete(self._listen())
        self._ready.set()
        self.loop.run_forever()
        for writer in list(self._writers):
            writer.transport.abort()
        if self._server is not None:
            self._server.close()
        self.loop.run_until_complete(self._http.aclose())
        self.loop.close()

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, "127.0.0.1", self.port, reuse_address=True
        )
        self.port = self._server.sockets[0].getsockname()[1]

    async def _restart(self) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        await asyncio.sleep(self.restart_s)
        await self._listen()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._writers.add(writer)
        try:
            while True:
                request = await _read_request(reader)
                if request is None:
                    return
                if not await self._answer(request, reader, writer):
                    return
        except (ConnectionError, asyncio.IncompleteReadError):
            return
        finally:
            self._writers.discard(writer)
            with contextlib.suppress(Exception):
                writer.close()

    async def _answer(
        self,
        request: tuple[str, str, bytes],
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> bool:
        method, path, body = request
        key = request_key(body) if path.endswith("/chat/completions") else None
        action = "pass"
        if key is not None:
            self.attempts[key] += 1
            action = self.plan(key, self.attempts[key])
            self.faults[action] += 1
        if action in ("429", "500"):
            await _respond(writer, int(action), {"error": {"message": f"injected {action}"}})
            return True
        if action == "hang":
            await reader.read()  # until the client gives up and closes
            return False
        if action == "drop":
            writer.transport.abort()
            return False
        if action == "restart":
            writer.transport.abort()
            asyncio.get_running_loop().create_task(self._restart())
            return False
        if key is not None:
            await self._open.wait()
        if key is not None and self.delay_s:
            await asyncio.sleep(self.delay_s)
        assert self._http is not None
        answer = await self._http.request(
            method, path, content=body, headers={"content-type": "application/json"}
        )
        await _respond_raw(writer, answer.status_code, answer.content)
        return True


async def _read_request(reader: asyncio.StreamReader) -> tuple[str, str, bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    lines = head.decode("latin-1").split("\r\n")
    method, path, _ = lines[0].split(" ", 2)
    length = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        if name.strip().lower() == "content-length":
            length = int(value.strip())
    body = await reader.readexactly(length) if length else b""
    return method, path, body


async def _respond(writer: asyncio.StreamWriter, status: int, payload: Any) -> None:
    await _respond_raw(writer, status, json.dumps(payload).encode())


async def _respond_raw(writer: asyncio.StreamWriter, status: int, body: bytes) -> None:
    head = (
        f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    )
    writer.write(head.encode() + body)
    await writer.drain()
