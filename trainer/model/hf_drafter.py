"""The drafter as a transformers `PreTrainedModel`: what `AutoModel.from_pretrained(export,
trust_remote_code=True)` returns (the z-lab README's way of loading a DFlash drafter).

The export writes a self-contained `dflash.py` next to the weights (`trainer.model.remote_code`
generates it from this module and the drafter's own source, so there is one drafter
implementation, not a copy to keep in sync); `config.json` points `auto_map.AutoModel` at
`dflash.DFlashDraftModel`. The config stays a plain Qwen3 config (`model_type=qwen3`), as z-lab's
and SpecForge's exports are, so serving engines read it unchanged.

`DFlashDraftModel` registers the project drafter's own modules under the z-lab state-dict names
(`fc`, `hidden_norm`, `layers.N...`, `norm`) and runs the project drafter's forward on them, so
its outputs are the project's bit for bit. Like the project drafter it borrows the target's
embedding and LM head: call `bind_target(target.get_input_embeddings(),
target.get_output_embeddings())` before `forward`/`logits`, or let `spec_generate` do it (the
z-lab README's next call: greedy speculative decoding with the project's own loop).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn
from transformers import PreTrainedModel, Qwen3Config

from trainer.model.attention import AttnMask
from trainer.model.drafter import DFlashDrafter, DrafterCache, DrafterConfig
from trainer.model.layers import RMSNorm, Rotary
from trainer.model.speculative import speculative_generate
from trainer.model.target import TargetModel


def drafter_config_from_hf(config: Any) -> DrafterConfig:
    """The drafter's config from the export's `config.json` as transformers parsed it."""
    dflash = getattr(config, "dflash_config", None) or {}
    rope = getattr(config, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(config, "rope_theta", None) or 1_000_000.0)
    return DrafterConfig(
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None)
        or config.hidden_size // config.num_attention_heads,
        vocab_size=config.vocab_size,
        block_size=config.block_size,
        mask_token_id=dflash["mask_token_id"],
        target_layer_ids=list(dflash["target_layer_ids"]),
        num_target_layers=config.num_target_layers,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=float(theta),
        max_position_embeddings=config.max_position_embeddings,
        initializer_range=config.initializer_range,
    )


# transformers leaves PreTrainedModel.__init_subclass__ and post_init unannotated.
class DFlashDraftModel(PreTrainedModel):  # type: ignore[no-untyped-call]
    """A DFlash drafter loadable with `AutoModel.from_pretrained(..., trust_remote_code=True)`."""

    _core: DFlashDrafter  # set outside the module tree (see __init__)

    config_class = Qwen3Config
    base_model_prefix = "dflash"
    main_input_name = "features"

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        core = DFlashDrafter(drafter_config_from_hf(config))
        # The same module objects, registered here under the z-lab names; the core itself is
        # kept out of the module tree so every weight has exactly one state-dict key.
        self.fc = core.fc
        self.hidden_norm = core.hidden_norm
        self.layers = core.layers
        self.norm = core.norm
        self.rotary = core.rotary
        object.__setattr__(self, "_core", core)
        self.drafter_config = core.config
        # The attribute names z-lab's DFlashDraftModel exposes.
        self.block_size = core.config.block_size
        self.mask_token_id = core.config.mask_token_id
        self.target_layer_ids = list(core.config.target_layer_ids)
        self.post_init()  # type: ignore[no-untyped-call]

    def _init_weights(self, module: nn.Module) -> None:
        std = self.drafter_config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)
        elif isinstance(module, Rotary):
            # A non-persistent buffer: recompute it wherever the weights were materialised.
            head_dim, theta = self.drafter_config.head_dim, self.drafter_config.rope_theta
            exponents = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
            module.inv_freq = (1.0 / (theta**exponents)).to(module.inv_freq.device)

    def bind_target(self, embed_tokens: nn.Embedding, lm_head: nn.Linear) -> None:
        """Borrow the target's embedding and LM head (by reference, never copied)."""
        self._core.bind_target(embed_tokens, lm_head)

    def block_input_ids(self, anchor_ids: Tensor) -> Tensor:
        return self._core.block_input_ids(anchor_ids)

    def project_context(self, features: Tensor) -> Tensor:
        return self._core.project_context(features)

    def forward(
        self,
        features: Tensor,
        block_ids: Tensor,
        block_positions: Tensor,
        mask: AttnMask = None,
        context_positions: Tensor | None = None,
        cache: DrafterCache | None = None,
    ) -> Tensor:
        """The project drafter's forward (see `DFlashDrafter.forward`): normed block states."""
        out: Tensor = self._core(
            features, block_ids, block_positions, mask, context_positions, cache
        )
        return out

    def logits(self, hidden: Tensor) -> Tensor:
        """Full-vocabulary logits through the borrowed target LM head."""
        return self._core.logits(hidden)

    @torch.no_grad()
    def spec_generate(
        self,
        input_ids: Tensor,
        max_new_tokens: int,
        temperature: float = 0.0,
        target: PreTrainedModel | None = None,
        stop_token_ids: list[int] | None = None,
        mask_token_id: int | None = None,
    ) -> Tensor:
        """z-lab's README call: greedy speculative decoding of `input_ids` [1, P] with `target`
        (the Hugging Face causal LM this drafter was trained on). Returns [1, P + new] ids;
        the new ids are exactly the target's greedy output."""
        if target is None:
            raise ValueError("spec_generate needs target= (the causal LM the drafter serves)")
        if temperature != 0.0:
            raise ValueError("only greedy decoding (temperature=0.0) is implemented")
        if input_ids.ndim != 2 or input_ids.shape[0] != 1:
            raise ValueError(f"input_ids must be [1, P], got {list(input_ids.shape)}")
        if mask_token_id is not None and mask_token_id != self.mask_token_id:
            raise ValueError(
                f"mask_token_id {mask_token_id} differs from the trained one ({self.mask_token_id})"
            )
        # One capture wrapper per target (its forward hooks stay registered, idle when unused).
        wrapped: TargetModel | None = self.__dict__.get("_spec_target")
        if wrapped is None or wrapped.model is not target:
            wrapped = TargetModel(target, self.target_layer_ids)
            self.__dict__["_spec_target"] = wrapped
        self.bind_target(wrapped.embed_tokens, wrapped.lm_head)
        out = speculative_generate(
            wrapped, self._core, input_ids[0].tolist(), max_new_tokens, stop_token_ids
        )
        new = torch.tensor([out.tokens], dtype=input_ids.dtype, device=input_ids.device)
        return torch.cat([input_ids, new], dim=1)
