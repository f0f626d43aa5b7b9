"""The DFlash drafter: fused target features injected as extra keys/values in every layer.

Forward for one sequence (reference §1.3):
    c = hidden_norm(fc(concat(target layer outputs)))            # once per context position
    z = embed([x_a, mask, ..., mask])                             # the block, size B
    per layer: Q from the block only; K, V = proj([c ; block]) through the same weights,
               QK-norm per head, RoPE at absolute positions (context 0..S-1, block a..a+B-1;
               packed rows: positions inside each document, `context_positions`)
    out = norm(z); logits = target lm_head(out); slot k predicts token a+k.
State-dict names follow z-lab (`fc`, `hidden_norm`, `layers.N.self_attn.q_proj`, ...), so
exports load in serving engines. The target's embedding and LM head are borrowed by
reference, never registered: they stay out of state_dict, optimizers and DDP.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from trainer.model.attention import AttnMask, attend, mask_keys
from trainer.model.documents import ContextRows
from trainer.model.layers import RMSNorm, Rotary, SwiGLU, apply_rotary

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}

ContextGroups = list[tuple[slice, Tensor]]
"""Per attention group of unpacked documents: its rows and their context's flat positions in
the packed rows ([rows, width]); see `trainer.model.documents.ContextRows`."""


class DrafterConfig(BaseModel):
    """Shape of a drafter and the two facts that tie it to its target (layer ids, mask id)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    hidden_size: int = Field(gt=0)
    intermediate_size: int = Field(gt=0)
    num_layers: int = Field(default=5, gt=0)
    num_attention_heads: int = Field(gt=0)
    num_key_value_heads: int = Field(gt=0)
    head_dim: int = Field(gt=0)
    vocab_size: int = Field(gt=0)  # target embedding rows
    block_size: int = Field(default=16, ge=2)
    mask_token_id: int = Field(ge=0)
    target_layer_ids: list[int]
    num_target_layers: int = Field(gt=0)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 40960
    initializer_range: float = 0.02

    @model_validator(mode="after")
    def _check(self) -> DrafterConfig:
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.mask_token_id >= self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is not a row of the {self.vocab_size}-row "
                "target embedding"
            )
        ids = self.target_layer_ids
        if not ids or sorted(set(ids)) != ids or ids[0] < 0 or ids[-1] >= self.num_target_layers:
            raise ValueError(
                f"target_layer_ids {ids} must be ascending ids of a "
                f"{self.num_target_layers}-layer target"
            )
        return self

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @classmethod
    def from_target(
        cls,
        target: Any,
        *,
        mask_token_id: int,
        num_layers: int = 5,
        block_size: int = 16,
        **overrides: Any,
    ) -> DrafterConfig:
        """Copy the target's width, heads and RoPE base; layer ids come from the capture."""
        tc = target.config
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 1_000_000.0))
        fields: dict[str, Any] = {
            "hidden_size": target.hidden_size,
            "intermediate_size": tc.intermediate_size,
            "num_layers": num_layers,
            "num_attention_heads": tc.num_attention_heads,
            "num_key_value_heads": tc.num_key_value_heads,
            "head_dim": getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads,
            "vocab_size": target.vocab_size,
            "block_size": block_size,
            "mask_token_id": mask_token_id,
            "target_layer_ids": list(target.layer_ids),
            "num_target_layers": target.num_layers,
            "rms_norm_eps": tc.rms_norm_eps,
            "rope_theta": float(theta),
            "max_position_embeddings": tc.max_position_embeddings,
        }
        fields.update(overrides)
        return cls(**fields)


def default_gamma(block_size: int) -> float:
    """Loss decay constant: 7/5/4 for block 16/10/8 (paper), interpolated elsewhere."""
    if block_size in DEFAULT_GAMMA:
        return DEFAULT_GAMMA[block_size]
    if block_size < 8:
        return block_size / 2.0
    if block_size > 16:
        return 7.0 * block_size / 16.0
    lo = max(b for b in DEFAULT_GAMMA if b < block_size)
    hi = min(b for b in DEFAULT_GAMMA if b > block_size)
    t = (block_size - lo) / (hi - lo)
    return DEFAULT_GAMMA[lo] + t * (DEFAULT_GAMMA[hi] - DEFAULT_GAMMA[lo])


def _autocasts(features: Tensor, weight: Tensor) -> bool:
    """Whether a linear layer of `features` by `weight` runs under autocast (which then casts
    both to its dtype): autocast is on for their device type and covers both dtypes."""
    cast = (torch.float32, torch.float16, torch.bfloat16)  # autocast leaves float64 alone
    covered = features.dtype in cast and weight.dtype in cast
    return covered and torch.is_autocast_enabled(features.device.type)


def _keys(parts: list[Tensor], width: int | None) -> Tensor:
    """[context; block] keys (or values) along dim 2, zero-padded to the `width` keys a dense
    mask carries (`attention.pad_keys`: those are masked off; None = no padding)."""
    have = sum(p.shape[2] for p in parts)
    if width is not None and width > have:
        first = parts[0]
        parts = [
            *parts,
            first.new_zeros(first.shape[0], first.shape[1], width - have, first.shape[3]),
        ]
    return torch.cat(parts, dim=2)


class DrafterAttention(nn.Module):
    """GQA attention whose queries come from the block and keys/values from [context; block]."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = cfg.num_key_value_heads
        self.head_dim = d
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def _kv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        b, t, d = x.shape[0], x.shape[1], self.head_dim
        k = self.k_norm(self.k_proj(x).view(b, t, self.num_kv_heads, d)).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, d).transpose(1, 2)
        return apply_rotary(k, *rope), v

    def _packed_kv(self, x: Tensor, rope: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        """`_kv` of packed rows x [R, S, H] in [R * S, Hkv, d] layout, ready to gather."""
        b, t, d, h = x.shape[0], x.shape[1], self.head_dim, self.num_kv_heads
        cos, sin = (r.transpose(1, 2) for r in rope)  # [R, S, 1, d]: per position, any head
        k = apply_rotary(self.k_norm(self.k_proj(x).view(b, t, h, d)), cos, sin)
        v = self.v_proj(x).view(b, t, h, d)
        return k.flatten(0, 1), v.flatten(0, 1)

    def forward(
        self,
        u: Tensor,
        context: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_ctx: tuple[Tensor, Tensor],
        mask: AttnMask,
        past: tuple[Tensor, Tensor] | None = None,
        context_groups: ContextGroups | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """Attention output and the context K/V (past + new) for the drafter cache.

        Context and block go through the same k/v projections; the block's own keys sit at
        the queries' positions, so they share `rope_q`. `context_groups`: `context` is packed
        rows; each group of rows gathers its context K/V from them and attends on its own,
        with its own mask (`mask` is then the groups' masks, in order); the K/V returned are
        then the packed rows'.
        """
        b, q_len, d = u.shape[0], u.shape[1], self.head_dim
        q = self.q_norm(self.q_proj(u).view(b, q_len, self.num_heads, d)).transpose(1, 2)
        q = apply_rotary(q, *rope_q)
        k_blk, v_blk = self._kv(u, rope_q)
        scale = self.head_dim**-0.5
        if context_groups is not None:
            if not isinstance(mask, tuple) or past is not None:
                raise ValueError("context_groups take one mask per group and no cache")
            k_packed, v_packed = self._packed_kv(context, rope_ctx)
            packed = (k_packed, v_packed)
            out = self._attend_groups(q, k_blk, v_blk, packed, context_groups, mask, scale)
            return self.o_proj(out.transpose(1, 2).flatten(2)), (k_packed, v_packed)
        k_ctx, v_ctx = self._kv(context, rope_ctx)
        if past is not None:
            k_ctx, v_ctx = torch.cat([past[0], k_ctx], dim=2), torch.cat([past[1], v_ctx], dim=2)
        k = _keys([k_ctx, k_blk], mask_keys(mask))
        v = _keys([v_ctx, v_blk], mask_keys(mask))
        out = attend(q, k, v, mask, scale=scale)
        return self.o_proj(out.transpose(1, 2).flatten(2)), (k_ctx, v_ctx)

    def _attend_groups(
        self,
        q: Tensor,
        k_blk: Tensor,
        v_blk: Tensor,
        packed: tuple[Tensor, Tensor],
        groups: ContextGroups,
        masks: tuple[AttnMask, ...],
        scale: float,
    ) -> Tensor:
        """Each group's queries over its context K/V gathered from the `packed` rows' and its
        own blocks', with its own mask; the groups' outputs in row order."""
        outs = []
        for (rows, index), mask in zip(groups, masks, strict=True):
            n, width = index.shape
            flat = index.flatten()
            k_g, v_g = (t.index_select(0, flat).view(n, width, *t.shape[1:]) for t in packed)
            keys = mask_keys(mask)
            k = _keys([k_g.transpose(1, 2), k_blk[rows]], keys)
            v = _keys([v_g.transpose(1, 2), v_blk[rows]], keys)
            outs.append(attend(q[rows], k, v, mask, scale=scale))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)


class DrafterLayer(nn.Module):
    """Pre-norm Qwen3 layer; the context enters K/V without a per-layer norm."""

    def __init__(self, cfg: DrafterConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = DrafterAttention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = SwiGLU(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self,
        z: Tensor,
        context: Tensor,
        rope_q: tuple[Tensor, Tensor],
        rope_ctx: tuple[Tensor, Tensor],
        mask: AttnMask,
        past: tuple[Tensor, Tensor] | None = None,
        context_groups: ContextGroups | None = None,
    ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        attn, kv = self.self_attn(
            self.input_layernorm(z), context, rope_q, rope_ctx, mask, past, context_groups
        )
        z = z + attn
        return z + self.mlp(self.post_attention_layernorm(z)), kv


@dataclass
class DrafterCache:
    """Per-layer K/V (after k_norm and RoPE) of the context positions committed so far.

    Speculative decoding feeds only newly committed features each step instead of
    re-projecting the whole context (fc alone is 5H x H per position at Qwen3-8B size).
    """

    layers: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    length: int = 0


class DFlashDrafter(nn.Module):
    """Trainable drafter; borrows the target's frozen `embed_tokens` and `lm_head`."""

    def __init__(
        self,
        config: DrafterConfig,
        embed_tokens: nn.Embedding | None = None,
        lm_head: nn.Linear | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.fc = nn.Linear(config.num_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.rotary = Rotary(config.head_dim, config.rope_theta)
        self._borrowed: tuple[nn.Embedding, nn.Linear] | None = None
        # Activation checkpointing per layer (training memory, not shape): off unless the run
        # config asks (`model.drafter.checkpoint_layers`); never in state_dict or exports.
        self.checkpoint_layers = False
        self.reset_parameters()
        if embed_tokens is not None and lm_head is not None:
            self.bind_target(embed_tokens, lm_head)

    def reset_parameters(self) -> None:
        """HF-style init: normal(0, initializer_range) linears, unit norms."""
        for module in self.modules():
            if isinstance(module, nn.Linear):
                nn.init.normal_(module.weight, std=self.config.initializer_range)
            elif isinstance(module, RMSNorm):
                nn.init.ones_(module.weight)

    def bind_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Borrow the target's modules by reference (not registered as submodules)."""
        rows, width = embed_tokens.weight.shape
        cfg = self.config
        if rows != cfg.vocab_size or width != cfg.hidden_size:
            raise ValueError(
                f"target embedding is {rows}x{width}, drafter expects "
                f"{cfg.vocab_size}x{cfg.hidden_size}"
            )
        if lm_head.weight.shape[1] != cfg.hidden_size:
            raise ValueError(f"target lm_head width {lm_head.weight.shape[1]} != {cfg.hidden_size}")
        self._borrowed = (embed_tokens, lm_head)

    def _borrow(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._borrowed is None:
            raise RuntimeError("drafter is not bound to a target: call bind_target()")
        return self._borrowed

    @property
    def embed_tokens(self) -> nn.Embedding:
        return self._borrow()[0]

    @property
    def lm_head(self) -> nn.Linear:
        return self._borrow()[1]

    def project_context(self, features: Tensor) -> Tensor:
        """hidden_norm(fc(features)): the fused context, shared by all layers.

        Under autocast the [R, S, F*H] features go to `fc` as they are: autocast casts them to
        its compute dtype itself, so bf16 features under bf16 autocast are never copied (a cast
        to the fp32 master weights' dtype first was a full fp32 copy of them, cast back again,
        for the same result: bf16 -> fp32 -> bf16 is exact). Without autocast they are cast to
        the weight's dtype when it differs, as `fc` needs."""
        weight = self.fc.weight
        if features.dtype != weight.dtype and not _autocasts(features, weight):
            features = features.to(weight.dtype)
        fused: Tensor = self.hidden_norm(self.fc(features))
        return fused

    def block_input_ids(self, anchor_ids: Tensor) -> Tensor:
        """[x_a, mask, ..., mask] for anchor token ids [..., N] -> [..., N * B]."""
        b = self.config.block_size
        ids = anchor_ids.new_full((*anchor_ids.shape, b), self.config.mask_token_id)
        ids[..., 0] = anchor_ids
        return ids.flatten(-2)

    def forward(
        self,
        features: Tensor,
        block_ids: Tensor,
        block_positions: Tensor,
        mask: AttnMask = None,
        context_positions: Tensor | None = None,
        cache: DrafterCache | None = None,
        context_rows: ContextRows | None = None,
    ) -> Tensor:
        """Normed hidden states of the block tokens.

        Args:
            features: [B, S, F*H] captured target features of the context (with
                `context_rows`: of the packed rows [R, S, F*H] the context rows come from).
            block_ids: [B, Q] block token ids (anchors and mask tokens).
            block_positions: [B, Q] positions of the block tokens (packed rows: relative to
                the anchor's document, as `context_positions`).
            mask: None (every block token sees all context and the whole block: inference
                with one block) or a training mask from `attention.build_mask`.
            context_positions: [B, S] context positions (default 0..S-1, or following the
                cached ones; packed rows: restarting at 0 at each document). Not with
                `context_rows`, which carries the packed rows' positions.
            cache: inference only. `features` are then the positions committed since the
                last call; their per-layer K/V are appended to the cache, and the block
                attends to everything cached. The block's own K/V are never cached.
            context_rows: training on unpacked documents of packed rows
                (`trainer.model.documents`): row b's context is the packed positions
                `context_rows.index[b]`, projected on the packed rows and gathered per layer,
                each of its groups attended apart; `mask` is then the groups' masks.

        Returns:
            [B, Q, H]; feed to `logits` or to the fused LM-head CE with `lm_head.weight`.
        """
        context = self.project_context(features)
        z = self.embed_tokens(block_ids).to(context.dtype)
        start = 0 if cache is None else cache.length
        if cache is not None and mask is not None:
            raise ValueError("the drafter cache is for unmasked inference drafting only")
        groups: ContextGroups | None = None
        if context_rows is not None:
            if cache is not None or context_positions is not None:
                raise ValueError("context_rows carries the packed rows' positions; no cache")
            index = context_rows.index.to(features.device)
            groups = [(rows, index[rows, :width]) for rows, width in context_rows.spans()]
            context_positions = context_rows.positions.to(features.device)
        if context_positions is None:
            context_positions = torch.arange(
                start, start + features.shape[1], device=features.device
            ).expand(features.shape[0], -1)
        rope_q = self.rotary(block_positions, z.dtype)
        rope_ctx = self.rotary(context_positions, z.dtype)
        new_kv = []
        for i, layer in enumerate(self.layers):
            past = cache.layers[i] if cache is not None and cache.layers else None
            if self.checkpoint_layers and cache is None and torch.is_grad_enabled():
                from torch.utils.checkpoint import checkpoint

                # Keep only the layer's inputs; backward re-runs its forward (autocast included).
                z, kv = checkpoint(
                    layer, z, context, rope_q, rope_ctx, mask, past, groups, use_reentrant=False
                )
            else:
                z, kv = layer(z, context, rope_q, rope_ctx, mask, past, groups)
            new_kv.append(kv)
        if cache is not None:
            cache.layers = new_kv
            cache.length = start + features.shape[1]
        out: Tensor = self.norm(z)
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        """Full-vocabulary logits through the target's LM head (inference / small tests)."""
        logits: Tensor = self.lm_head(hidden.to(self.lm_head.weight.dtype))
        return logits
