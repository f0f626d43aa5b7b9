"""One generation request of a row, retried with jittered backoff within the row's budget.

Every failed attempt (`client.Failure`) takes one from the row's budget (`--max-retries` for
the whole row, all its turns together): a row that keeps failing ends in the errors file with
its last reason, never loops. A `permanent` failure ends the row at once. A `gone` server is
marked down and the retry waits in the pool for any server that is up (no backoff of its own:
the pool's probe is the wait); other retries sleep a full-jitter exponential backoff first
(uniform in [0, min(cap, base * 2^k)]: retries of many rows spread out instead of returning
together).
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

from trainer.regen.client import Failure, chat
from trainer.regen.replies import Reply
from trainer.regen.servers import Server, ServerPool

BACKOFF_CAP_S = 30.0


class RowFailed(Exception):
    """A row that cannot be regenerated: why (one line), and how many attempts it took."""

    def __init__(self, reason: str, detail: str, attempts: int) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail, self.attempts = reason, detail, attempts


@dataclass
class Budget:
    """A row's retries: `max_retries` failed attempts over all its requests."""

    max_retries: int
    failed: int = 0
    attempts: int = 0
    last_server: Server | None = None


@dataclass
class Counts:
    """What every request of the job did (read by the status line)."""

    requests: int = 0
    retries: int = 0
    by_kind: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0


def backoff_s(
    failed: int, base_s: float, rng: random.Random, cap_s: float = BACKOFF_CAP_S
) -> float:
    """Full jitter: uniform in [0, min(cap, base * 2^(failed-1))]."""
    return rng.uniform(0.0, min(cap_s, base_s * 2.0 ** max(0, failed - 1)))


class Requester:
    """Sends the job's requests: the fixed part of the body (model, sampling, mode kwargs)
    plus each request's messages and tools."""

    def __init__(
        self,
        pool: ServerPool,
        http: httpx.AsyncClient,
        body: dict[str, Any],
        backoff_base_s: float,
        seed: int | None = None,
    ) -> None:
        self.pool, self.http, self.body = pool, http, body
        self.backoff_base_s = backoff_base_s
        self.rng = random.Random(seed)
        self.counts = Counts()

    async def ask(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, budget: Budget
    ) -> Reply:
        body = {**self.body, "messages": messages}
        if tools:
            body["tools"] = tools
        while True:
            server = await self.pool.acquire(budget.last_server)
            budget.attempts += 1
            self.counts.requests += 1
            try:
                reply = await chat(self.http, server.url, body)
            except Failure as failure:
                failed: Failure | None = failure
            else:
                failed = None
            finally:
                await self.pool.release(server)
            if failed is None:
                budget.last_server = server
                self.counts.prompt_tokens += reply.prompt_tokens
                self.counts.completion_tokens += reply.completion_tokens
                return reply
            self.counts.by_kind[failed.kind] = self.counts.by_kind.get(failed.kind, 0) + 1
            if failed.kind == "permanent":
                raise RowFailed("refused", failed.reason, budget.attempts)
            budget.failed += 1
            if budget.failed > budget.max_retries:
                raise RowFailed(
                    "retries_exhausted",
                    f"{budget.failed} failed attempts (--max-retries {budget.max_retries}); "
                    f"last: {failed.reason}",
                    budget.attempts,
                )
            self.counts.retries += 1
            if failed.kind == "gone":
                await self.pool.mark_down(server, failed.reason)
            else:
                await asyncio.sleep(backoff_s(budget.failed, self.backoff_base_s, self.rng))
