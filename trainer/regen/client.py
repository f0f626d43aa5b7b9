"""One chat-completion request over HTTP (httpx, async), its failure classified.

Three kinds of failure (`Failure.kind`), which decide what the caller does:

* `gone`: the server cannot be reached (connection refused, connect timeout): it went away;
  the pool marks it down and waits for it (`servers`), the row's attempt counts.
* `retry`: worth another try after a backoff: a read/write timeout (a hang), a dropped
  connection, HTTP 408, 409, 425, 429 and every 5xx, and a 200 whose body is not a usable
  completion (a proxy cut it short).
* `permanent`: any other 4xx (the server refuses this request: a prompt past its context, an
  unknown model): retrying cannot help, the row goes to the errors file at once.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import httpx

from trainer.regen.replies import Reply, ReplyError, parse_reply

RETRY_STATUSES = frozenset({408, 409, 425, 429})
Kind = Literal["gone", "retry", "permanent"]
CONNECT_TIMEOUT_S = 10.0


class Failure(Exception):
    """A request that did not produce a reply: its kind and a one-line reason naming the URL."""

    def __init__(self, kind: Kind, reason: str) -> None:
        super().__init__(reason)
        self.kind: Kind = kind
        self.reason = reason


def _first_line(text: str, limit: int = 200) -> str:
    """An error body's message (OpenAI's `{"error": {"message": ...}}`), else its first line."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = None
    if isinstance(message, str) and message.strip():
        text = message
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[0][:limit] if lines else "(empty body)"


def _transport_reason(err: httpx.TransportError) -> str:
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0]}" if text and text[0] else type(err).__name__


def classify_status(status: int) -> Kind:
    return "retry" if status in RETRY_STATUSES or status >= 500 else "permanent"


def new_http(timeout_s: float, connections: int) -> httpx.AsyncClient:
    """The job's one client: `timeout_s` bounds a request's reads (a hang past it is a retry),
    connects give up after CONNECT_TIMEOUT_S; no environment proxies (a container's
    HTTP_PROXY must not reroute a loopback engine)."""
    return httpx.AsyncClient(
        timeout=httpx.Timeout(timeout_s, connect=CONNECT_TIMEOUT_S),
        limits=httpx.Limits(max_connections=connections, max_keepalive_connections=connections),
        trust_env=False,
    )


async def chat(http: httpx.AsyncClient, url: str, body: dict[str, Any]) -> Reply:
    """POST `body` to URL/v1/chat/completions; the reply, or a classified Failure."""
    endpoint = f"{url}/v1/chat/completions"
    try:
        response = await http.post(endpoint, json=body)
    except (httpx.ConnectError, httpx.ConnectTimeout) as err:
        raise Failure("gone", f"{url}: {_transport_reason(err)}") from None
    except httpx.TimeoutException as err:
        raise Failure(
            "retry", f"{url}: no answer within the request timeout ({type(err).__name__})"
        ) from None
    except httpx.TransportError as err:  # reset, dropped mid-answer, protocol errors
        raise Failure("retry", f"{url}: {_transport_reason(err)}") from None
    if response.status_code != 200:
        detail = _first_line(response.text)
        kind = classify_status(response.status_code)
        raise Failure(kind, f"{endpoint}: HTTP {response.status_code}: {detail}")
    try:
        return parse_reply(response.json())
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise Failure(
            "retry", f"{endpoint}: the answer is not JSON: {response.text[:120]!r}"
        ) from None
    except ReplyError as err:
        raise Failure("retry", f"{endpoint}: {err}") from None


def _context(model: dict[str, Any]) -> int | None:
    value = model.get("max_model_len")
    return value if type(value) is int and value > 0 else None


async def models(http: httpx.AsyncClient, url: str) -> dict[str, int | None]:
    """The models URL/v1/models lists, with their context length where the server says it
    (vLLM's `max_model_len`); a health probe too: Failure when it does not answer."""
    try:
        response = await http.get(f"{url}/v1/models", timeout=httpx.Timeout(10.0))
    except httpx.TransportError as err:
        raise Failure("gone", f"{url}: {_transport_reason(err)}") from None
    if response.status_code != 200:
        raise Failure(
            classify_status(response.status_code),
            f"{url}/v1/models: HTTP {response.status_code}: {_first_line(response.text)}",
        )
    try:
        data = response.json()
        return {str(m["id"]): _context(m) for m in data["data"]}
    except (ValueError, KeyError, TypeError):
        raise Failure("retry", f"{url}/v1/models: no model list in the answer") from None
