"""vLLM's speculative-decoding counters, read from its Prometheus `/metrics` text. Pure.

vLLM (v1, `vllm/v1/spec_decode/metrics.py`) counts, per verify step of each request:
`vllm:spec_decode_num_drafts` (+1), `..._num_draft_tokens` (+K), `..._num_accepted_tokens`
(+accepted) and `..._num_accepted_tokens_per_pos` (+1 at each accepted position, label
`position`). A step commits accepted + 1 tokens (the bonus), so the mean accept length is
1 + accepted / drafts: the project's tau under the "exact" protocol, counted the same way
(`trainer.model.speculative`). Counters only grow: a run is measured by the difference of two
reads (`after - before`); several engines (label `engine`) are summed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from trainer.serving.errors import EngineError

PREFIX = "vllm:spec_decode_"
DRAFTS = PREFIX + "num_drafts"
DRAFT_TOKENS = PREFIX + "num_draft_tokens"
ACCEPTED = PREFIX + "num_accepted_tokens"
PER_POSITION = PREFIX + "num_accepted_tokens_per_pos"

# One sample line of the text exposition format: name{labels} value [timestamp].
_SAMPLE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class SpecCounters:
    """Verify steps (drafts), draft tokens, accepted tokens and accepted tokens per position."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted: int = 0
    per_position: tuple[int, ...] = ()

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        return self._combine(before, -1)

    def __add__(self, other: SpecCounters) -> SpecCounters:
        return self._combine(other, 1)

    def _combine(self, other: SpecCounters, sign: int) -> SpecCounters:
        width = max(len(self.per_position), len(other.per_position))
        mine = self.per_position + (0,) * (width - len(self.per_position))
        theirs = other.per_position + (0,) * (width - len(other.per_position))
        return SpecCounters(
            self.drafts + sign * other.drafts,
            self.draft_tokens + sign * other.draft_tokens,
            self.accepted + sign * other.accepted,
            tuple(a + sign * b for a, b in zip(mine, theirs, strict=True)),
        )

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (accepted + the bonus); 0 without steps."""
        return (self.accepted + self.drafts) / self.drafts if self.drafts else 0.0

    def rates(self) -> list[float]:
        """Share of verify steps that accepted the draft at each position."""
        return [n / self.drafts if self.drafts else 0.0 for n in self.per_position]


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        match = _SAMPLE.match(line)
        if match is None:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        out.setdefault(name.removesuffix("_total"), []).append(
            (dict(_LABEL.findall(labels or "")), number)
        )
    return out


def parse_spec_counters(text: str, source: str) -> SpecCounters:
    """The counters in a `/metrics` page (`source` names it in errors): counter samples are
    `NAME_total`, summed over engines; `_created` timestamps are ignored."""
    samples = _samples(text)
    if DRAFTS not in samples or ACCEPTED not in samples:
        raise EngineError(
            f"{source}: no {DRAFTS} counters: the engine is not running speculative decoding "
            "(start it with --speculative-config) or its stats are off (--disable-log-stats)"
        )

    def total(name: str) -> int:
        return round(sum(v for _, v in samples.get(name, [])))

    per_pos: dict[int, float] = {}
    for labels, value in samples.get(PER_POSITION, []):
        if labels.get("position", "").isdigit():
            k = int(labels["position"])
            per_pos[k] = per_pos.get(k, 0.0) + value
    width = max(per_pos) + 1 if per_pos else 0
    return SpecCounters(
        total(DRAFTS),
        total(DRAFT_TOKENS),
        total(ACCEPTED),
        tuple(round(per_pos.get(k, 0.0)) for k in range(width)),
    )
