"""The served half of `python -m trainer.eval --engine vllm`: an engine started for the run
(`--serve-cmd`) or already running (`--server URL`), each turn sent to it on the same token ids
the project's loop decoded, its counters read around the request, and the comparison.

The project's loop runs first on each turn (`trainer.eval.evaluate`), then the engine; the
conversation continues with the project's tokens (identical when both agree). The engine must
serve this run alone: its counters are global.
"""

from __future__ import annotations

import contextlib
import shlex
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from trainer.eval_results import PromptResult
from trainer.serving.client import EngineClient
from trainer.serving.compare import (
    Comparison,
    ServedTurn,
    compare,
    comparison_json,
    format_comparison,
    own_of,
    served_turn,
    served_turn_json,
)
from trainer.serving.errors import EngineError
from trainer.serving.launch import RunningEngine, free_port, served_engine, vllm_serve_argv


def serve_cmd_problem(serve_cmd: str | None) -> str | None:
    """Why `--serve-cmd` cannot be a command line (None when it can)."""
    if serve_cmd is None:
        return None
    try:
        words = shlex.split(serve_cmd)
    except ValueError as err:
        return f"--serve-cmd {serve_cmd!r}: {err}"
    return None if words else "--serve-cmd is empty"


@dataclass(frozen=True)
class EngineSpec:
    """How to reach the engine: a URL, or a command to start it with (`serve_cmd`)."""

    name: str
    server: str | None = None
    serve_cmd: str | None = None
    serve_args: tuple[str, ...] = ()
    timeout_s: float = 600.0
    log: Path | None = None


@dataclass
class ServedSession:
    """One engine for one evaluation, and what it did on each turn so far."""

    engine: str
    client: EngineClient
    version: str
    argv: list[str] | None
    log: Path | None
    max_new_tokens: int
    stop_ids: list[int]
    turns: list[ServedTurn] = field(default_factory=list)
    started: RunningEngine | None = None  # the engine this run started (None: --server)

    def turn(self, ids: Sequence[int], own: PromptResult) -> ServedTurn:
        tokens, counters = self.client.measured(
            ids, max_tokens=self.max_new_tokens, stop_ids=self.stop_ids
        )
        result = served_turn(own.index, own.tokens, tokens, counters)
        self.turns.append(result)
        return result

    def info(self) -> dict[str, Any]:
        return {
            "name": self.engine,
            "version": self.version,
            "url": self.client.url,
            "argv": self.argv,
            "command": shlex.join(self.argv) if self.argv else None,
            "log": str(self.log) if self.log else None,
        }


def format_turn(own: PromptResult, turn: ServedTurn, engine: str) -> str:
    same = "same" if turn.tokens_match else f"DIFFER from token {turn.first_difference}"
    c = turn.counters
    return (
        f"prompt {own.set}:{own.line} turn {own.turn}: {engine} tau={c.tau:.2f} "
        f"steps={c.drafts} new_tokens={len(turn.tokens)} tokens {same}"
    )


@contextlib.contextmanager
def open_session(
    spec: EngineSpec,
    *,
    target: Path,
    drafter: Path,
    block_size: int,
    dtype: str,
    max_new_tokens: int,
    stop_ids: list[int],
) -> Iterator[ServedSession]:
    """The engine for a run: connect to `spec.server`, or start `spec.serve_cmd` (stopped when
    the block ends)."""
    if spec.server is not None:
        with EngineClient(spec.server) as client:
            if not client.healthy():
                raise EngineError(f"{client.url}/health does not answer: is the engine running?")
            yield ServedSession(
                spec.name, client, client.version(), None, None, max_new_tokens, stop_ids
            )
        return
    if spec.serve_cmd is None:
        raise EngineError("--engine needs --server URL or --serve-cmd CMD")
    port = free_port()
    argv = vllm_serve_argv(
        shlex.split(spec.serve_cmd),
        target=target,
        drafter=drafter,
        block_size=block_size,
        port=port,
        dtype=dtype,
        extra=spec.serve_args,
    )
    log = spec.log or Path(tempfile.mkdtemp(prefix="dflash-engine-")) / f"{spec.name}-{port}.log"
    print(f"starting {spec.name}: {shlex.join(argv)} (log {log})", flush=True)
    with (
        served_engine(argv, port=port, log=log, timeout_s=spec.timeout_s) as engine,
        EngineClient(engine.url) as client,
    ):
        yield ServedSession(
            spec.name, client, client.version(), argv, log, max_new_tokens, stop_ids, [], engine
        )


def comparisons(
    session: ServedSession,
    results: Sequence[PromptResult],
    sets: Sequence[tuple[str, int]],
    block_size: int,
    tolerance: float,
) -> list[Comparison]:
    """One comparison per prompt set (given as (name, turns) in run order), then "all"."""
    served = {t.index: t for t in session.turns}
    out: list[Comparison] = []
    start = 0
    for name, turns in [*sets, ("all", len(results))]:
        chunk = results[start : start + turns] if name != "all" else results
        if name != "all":
            start += turns
        pairs = [(r, served[r.index]) for r in chunk if r.index in served]
        own = own_of([r for r, _ in pairs], block_size)
        out.append(compare(name, own, [t for _, t in pairs], tolerance=tolerance))
    return out


def report(
    session: ServedSession,
    results: Sequence[PromptResult],
    sets: Sequence[tuple[str, int]],
    block_size: int,
    tolerance: float,
) -> tuple[list[str], dict[str, Any], str | None]:
    """Lines to print, the JSON sections (`engine`, `served`) and, when the two loops differ
    beyond the tolerance, the one-line error saying so."""
    found = comparisons(session, results, sets, block_size, tolerance)
    engine = f"{session.engine} {session.version}"
    lines = [line for c in found for line in format_comparison(c, engine)]
    overall = found[-1]
    payload = {
        "engine": session.info(),
        "served": {
            "summary": comparison_json(overall),
            "sets": [comparison_json(c) for c in found[:-1]],
            "turns": [served_turn_json(t) for t in session.turns],
        },
    }
    problem = None
    if not overall.agree:
        problem = (
            f"{engine} acceptance differs from the project's loop beyond tolerance "
            f"({overall.allowed_steps} verify step(s) per position): "
            f"{'; '.join(overall.differences)}. The engine does not read this drafter as it was "
            "trained: check dflash_config.target_layer_ids, mask_token_id and the anchor layout "
            "(docs/serving.md)"
        )
    return lines, payload, problem
