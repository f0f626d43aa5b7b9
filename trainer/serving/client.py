"""A running engine over HTTP (httpx): health, version, greedy completions on token ids, and
the speculative-decoding counters. Every failure is one line naming the URL."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import httpx

from trainer.serving.errors import EngineError, EngineGone
from trainer.serving.metrics import SpecCounters, parse_spec_counters

SETTLE_S = 10.0
"""How long a turn's counters may take to show up in /metrics (vLLM records them in the same
event-loop pass that releases the response, so the first read nearly always has them)."""


def _reason(err: Exception) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text else type(err).__name__


class EngineClient:
    """One engine at `url` (e.g. http://127.0.0.1:8000). `timeout_s` bounds one request."""

    def __init__(self, url: str, *, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self._http = httpx.Client(
            base_url=self.url, timeout=httpx.Timeout(timeout_s, connect=10.0), trust_env=False
        )
        self._model: str | None = None

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> EngineClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as err:  # refused, reset, timed out: the engine is gone
            raise EngineGone(f"{self.url}: the engine went away ({_reason(err)})") from None
        if response.status_code != 200:
            body = response.text.strip().splitlines()
            detail = body[0][:300] if body else "(empty body)"
            raise EngineError(f"{self.url}{path}: HTTP {response.status_code}: {detail}")
        return response

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        response = self._request(method, path, **kwargs)
        try:
            return response.json()
        except ValueError:
            raise EngineError(f"{self.url}{path}: not JSON: {response.text[:200]!r}") from None

    def healthy(self) -> bool:
        """Whether GET /health answers 200 now (a refused connection is just "not yet")."""
        try:
            return self._http.get("/health", timeout=5.0).status_code == 200
        except httpx.TransportError:
            return False

    def version(self) -> str:
        data = self._json("GET", "/version")
        if not isinstance(data, dict) or not isinstance(data.get("version"), str):
            raise EngineError(f"{self.url}/version: no version in {data!r}")
        return str(data["version"])

    def model(self) -> str:
        """The served model's name (the first of /v1/models), cached."""
        if self._model is None:
            data = self._json("GET", "/v1/models")
            try:
                self._model = str(data["data"][0]["id"])
            except (KeyError, IndexError, TypeError):
                raise EngineError(f"{self.url}/v1/models: no model listed") from None
        return self._model

    def counters(self) -> SpecCounters:
        return parse_spec_counters(self._request("GET", "/metrics").text, f"{self.url}/metrics")

    def complete(
        self, prompt: Sequence[int], *, max_tokens: int, stop_ids: Sequence[int]
    ) -> list[int]:
        """Greedy completion of token ids; returns the generated ids (a stop id included, as
        the project's loop keeps it). The engine stops at exactly `stop_ids` (its own EOS rule
        is off: `ignore_eos`), so both loops stop at the same tokens."""
        body = {
            "model": self.model(),
            "prompt": list(prompt),
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "ignore_eos": True,
            "stop_token_ids": list(stop_ids),
            "return_token_ids": True,
            "skip_special_tokens": False,
        }
        data = self._json("POST", "/v1/completions", json=body)
        try:
            ids = data["choices"][0]["token_ids"]
        except (KeyError, IndexError, TypeError):
            raise EngineError(
                f"{self.url}/v1/completions: no choices[0].token_ids (an engine without "
                "return_token_ids?)"
            ) from None
        if not isinstance(ids, list) or not all(isinstance(i, int) for i in ids):
            raise EngineError(f"{self.url}/v1/completions: token_ids is not a list of ids")
        return ids

    def measured(
        self, prompt: Sequence[int], *, max_tokens: int, stop_ids: Sequence[int]
    ) -> tuple[list[int], SpecCounters]:
        """`complete` plus the counters it moved (read before and after).

        Each verify step commits accepted + 1 tokens after the one the prefill samples, and the
        last step may accept up to K drafts past a stop or the limit, so one request moves
        drafts + accepted into [n - 1, n - 1 + K] for n generated tokens. The after-read is
        repeated (at most SETTLE_S) until it reaches that range; beyond it, another client is
        using the engine and the figures would be theirs too.
        """
        before = self.counters()
        tokens = self.complete(prompt, max_tokens=max_tokens, stop_ids=stop_ids)
        low = len(tokens) - 1
        deadline = time.monotonic() + SETTLE_S
        while True:
            delta = self.counters() - before
            moved = delta.drafts + delta.accepted
            k = delta.draft_tokens // delta.drafts if delta.drafts else 0
            if moved > low + k:
                raise EngineError(
                    f"{self.url}/metrics: the counters moved by {moved} for a {len(tokens)}-token "
                    "completion: another client is using this engine (the served evaluation "
                    "needs it alone)"
                )
            if moved >= low:
                return tokens, delta
            if time.monotonic() > deadline:
                raise EngineError(
                    f"{self.url}/metrics: after {SETTLE_S:g} s the counters account for "
                    f"{moved} of the {len(tokens)}-token completion's {low} verified tokens"
                )
            time.sleep(0.05)
