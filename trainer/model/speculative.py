"""Greedy speculative decoding with a DFlash drafter, and the plain greedy baseline.

One step: the drafter drafts a block [x_t, mask x (B-1)] at positions t..t+B-1 from the
features of every committed token before t; the target verifies [x_t, d_1..d_{B-1}] in ONE
forward (KV cache), the longest prefix where d_k equals the target's argmax is accepted, plus
the target's own next token (the bonus). The verify forward also yields the features of the
tokens it commits, which feed the next draft; rejected positions are cropped from the cache.
With greedy verification the output is exactly the target's greedy output, so any mismatch is
a bug (or a numerics tie), which `trainer.eval` reports.

The drafter keeps a per-layer K/V cache of committed context positions (`DrafterCache`) and
only projects the features committed since its last draft; the block's own K/V are never
cached, so nothing needs cropping on the drafter side.

Counting protocols (they change `accept_lengths`, never the tokens):
- "exact": stop as soon as `max_new_tokens` are committed or a stop token is.
- "zlab": z-lab's `dflash_generate` loop (`while start < max_length`, stop checked after each
  verify step), which runs ONE more verify step when the committed tokens land exactly on the
  limit (and one step after a first token that is already a stop token), so its tau is a little
  lower on short limits. Use it to compare with published figures.
"""

from __future__ import annotations

import time
from collections.abc import Collection
from dataclasses import dataclass, field

import torch
from torch import Tensor

from trainer.model.drafter import DFlashDrafter, DrafterCache
from trainer.model.protocols import PROTOCOLS, Protocol
from trainer.model.target import TargetModel


@dataclass
class SpecOutput:
    """Generated tokens and per-verify-step acceptance of one prompt."""

    tokens: list[int]
    accept_lengths: list[int] = field(default_factory=list)  # accepted drafts + 1 bonus
    seconds: float = 0.0

    @property
    def tau(self) -> float:
        """Mean tokens committed per verify step (max = block size)."""
        return sum(self.accept_lengths) / len(self.accept_lengths) if self.accept_lengths else 0.0


def _as_prompt(prompt: list[int] | Tensor, device: torch.device) -> Tensor:
    ids = torch.as_tensor(prompt, dtype=torch.long, device=device).reshape(1, -1)
    if ids.shape[1] == 0:
        raise ValueError("empty prompt")
    return ids


StopIds = int | Collection[int] | None


def stop_set(eos_id: StopIds) -> frozenset[int]:
    """One stop id, several (a generation config's list) or none."""
    if eos_id is None:
        return frozenset()
    if isinstance(eos_id, int):
        return frozenset((eos_id,))
    return frozenset(int(i) for i in eos_id)


def _finish(tokens: list[int], max_new_tokens: int, stops: frozenset[int]) -> list[int]:
    tokens = tokens[:max_new_tokens]
    for i, tok in enumerate(tokens):
        if tok in stops:
            return tokens[: i + 1]
    return tokens


@torch.no_grad()
def greedy_generate(
    target: TargetModel, prompt: list[int] | Tensor, max_new_tokens: int, eos_id: StopIds = None
) -> SpecOutput:
    """Plain greedy decoding with a KV cache, one target forward per token (the reference).

    `eos_id`: one stop token id, several, or None (generate `max_new_tokens`).
    """
    stops = stop_set(eos_id)
    ids = _as_prompt(prompt, target.device)
    start = time.perf_counter()
    cache = target.new_cache()
    logits = target.logits(ids, cache)
    out: list[int] = []
    while True:
        tok = int(logits[0, -1].argmax())
        out.append(tok)
        if len(out) >= max_new_tokens or tok in stops:
            break
        nxt = torch.tensor([[tok]], device=target.device)
        logits = target.logits(nxt, cache)
    return SpecOutput(_finish(out, max_new_tokens, stops), seconds=time.perf_counter() - start)


@torch.no_grad()
def speculative_generate(
    target: TargetModel,
    drafter: DFlashDrafter,
    prompt: list[int] | Tensor,
    max_new_tokens: int,
    eos_id: StopIds = None,
    *,
    drafter_cache: bool = True,
    protocol: Protocol = "exact",
) -> SpecOutput:
    """Greedy speculative decoding; `accept_lengths` has one entry per verify forward.

    `eos_id`: one stop token id, several, or None. `protocol`: how verify steps are counted
    (module docstring); the tokens are the same under both. `drafter_cache=False`
    re-projects the whole context every step (the reference the cached path is tested
    against).
    """
    if protocol not in PROTOCOLS:
        raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    stops = stop_set(eos_id)
    # z-lab loops while start < num_input + max_new, start = the anchor's position.
    limit = max_new_tokens + 1 if protocol == "zlab" else max_new_tokens
    if list(target.layer_ids) != list(drafter.config.target_layer_ids):
        raise ValueError(
            f"drafter reads layers {drafter.config.target_layer_ids}, target captures "
            f"{list(target.layer_ids)}"
        )
    bsz, mask_id = drafter.config.block_size, drafter.config.mask_token_id
    device = target.device
    ids = _as_prompt(prompt, device)
    start = time.perf_counter()
    cache = target.new_cache()
    logits, pending = target.forward_with_capture(ids, cache=cache)
    context = pending  # all committed features; only kept when the drafter cache is off
    committed_len = ids.shape[1]
    dcache = DrafterCache() if drafter_cache else None
    anchor = int(logits[0, -1].argmax())
    out = [anchor]
    accept: list[int] = []
    offsets = torch.arange(bsz, device=device)
    # "exact" never verifies after a stop token; z-lab checks only after a verify step.
    stopped = protocol == "exact" and anchor in stops
    while len(out) < limit and not stopped:
        pos = committed_len  # the anchor's position: everything before it is committed
        block = torch.full((1, bsz), mask_id, dtype=torch.long, device=device)
        block[0, 0] = anchor
        feats = pending if dcache is not None else context
        hidden = drafter(feats, block, (pos + offsets)[None], cache=dcache)
        draft = drafter.logits(hidden[:, 1:]).argmax(-1)  # [1, B-1]
        verify_in = torch.cat([block[:, :1], draft], dim=1)
        vlogits, vfeats = target.forward_with_capture(verify_in, cache=cache)
        predicted = vlogits[0].argmax(-1)  # predicted[i]: target's token after verify_in[:i+1]
        matches = (draft[0] == predicted[:-1]).int()
        accepted = int(matches.cumprod(0).sum())
        committed = [*draft[0, :accepted].tolist(), int(predicted[accepted])]
        pending = vfeats[:, : accepted + 1]
        committed_len += accepted + 1
        if dcache is None:
            context = torch.cat([context, pending], dim=1)
        target.crop_cache(cache, pos + accepted + 1)
        out.extend(committed)
        accept.append(accepted + 1)
        anchor = committed[-1]
        stopped = any(t in stops for t in committed) or out[0] in stops
    return SpecOutput(_finish(out, max_new_tokens, stops), accept, time.perf_counter() - start)
