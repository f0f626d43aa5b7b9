"""The frozen target: load a local Hugging Face causal LM and capture decoder-layer outputs.

Index convention (the one that silently breaks drafters when it is off by one): layer id `i`
is the OUTPUT of decoder layer `i` (0-based), which is HF `output_hidden_states[i + 1]`
(entry 0 is the embedding output; the last entry is post-final-norm in recent transformers,
so it is never used here). Capture stops after the deepest requested layer by raising a
private exception from its forward hook: the remaining layers, the final norm and the LM head
never run — unless the last hidden state is asked for too (`capture(final=True)`, logit
distillation), which runs every layer and the final norm, never the LM head.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any, TypeVar

import torch
from torch import Tensor, nn
from transformers import DynamicCache, PreTrainedModel

from trainer.model.errors import TargetError
from trainer.model.target_load import load_causal_lm


class _StopForward(Exception):
    """Raised by the deepest capture hook to end the target forward early."""


def default_target_layer_ids(num_target_layers_total: int, num_draft_layers: int) -> list[int]:
    """DFlash rule: `n` ids spread uniformly from layer 1 to layer L-3, Python `round()`ed.

    `round()` is half to even, exactly as z-lab, SpecForge and SGLang compute it, so a drafter
    trained here reads the layers those loaders assume: (94, 5) -> [1, 24, 46, 68, 91] (half up
    would pick 69). One feature takes the middle layer. Examples: (36, 5) -> [1, 9, 17, 25, 33];
    (8, 2) -> [1, 5].
    """
    n, total = num_draft_layers, num_target_layers_total
    if n < 1:
        raise TargetError(f"num_draft_layers must be >= 1, got {n}")
    if total < 4 and n > 1:
        raise TargetError(f"a target with {total} layers is too shallow for {n} features")
    if n == 1:
        return [total // 2]
    start, end = 1, total - 3
    return [round(start + i * (end - start) / (n - 1)) for i in range(n)]


def validate_layer_ids(layer_ids: Sequence[int], num_layers: int) -> list[int]:
    """Ids must be distinct, ascending and inside [0, num_layers - 1]."""
    ids = [int(i) for i in layer_ids]
    if not ids:
        raise TargetError("target_layer_ids is empty")
    if sorted(set(ids)) != ids:
        raise TargetError(f"target_layer_ids must be strictly ascending, got {ids}")
    if ids[0] < 0 or ids[-1] >= num_layers:
        raise TargetError(f"target_layer_ids {ids} out of range for a {num_layers}-layer target")
    return ids


def default_dtype(device: torch.device | str) -> torch.dtype:
    """bf16 on accelerators (what serving uses), fp32 on CPU (bf16 matmuls are slow there)."""
    return torch.float32 if torch.device(device).type == "cpu" else torch.bfloat16


def _decoder_of(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The decoder (`model.model`, else `get_decoder()`) and its layer list."""
    decoder: object = getattr(model, "model", None)
    if decoder is None or not hasattr(decoder, "layers"):
        get = getattr(model, "get_decoder", None)
        decoder = get() if callable(get) else None
    layers = getattr(decoder, "layers", None)
    if not isinstance(decoder, nn.Module) or not isinstance(layers, nn.ModuleList):
        raise TargetError(f"{type(model).__name__} has no decoder layer list (model.layers)")
    return decoder, layers


def cache_keyword(model: nn.Module) -> str:
    """The name of the KV-cache argument of `model.forward`: `cache` (transformers 5) or
    `past_key_values` (4.x). 4.x swallows an unknown `cache=` into **kwargs and silently runs
    without a cache, so the name must be right, not merely accepted."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _layer_output(output: Tensor | tuple[Tensor, ...]) -> Tensor:
    # transformers 5 decoder layers return a tensor; older ones return (hidden, ...).
    return output[0] if isinstance(output, tuple) else output


_M = TypeVar("_M", bound=nn.Module)


def _own_module(model: nn.Module, module: object, kind: type[_M], what: str) -> _M:
    if not isinstance(module, kind):
        raise TargetError(
            f"{type(model).__name__}: {what} is a {type(module).__name__}, not nn.{kind.__name__}"
        )
    return module


class LayerCapture:
    """Forward hooks on the decoder layers in `layer_ids` of a HF causal LM, and the forwards
    that collect what those layers output (`capture`, `forward_with_capture`)."""

    def __init__(
        self, model: PreTrainedModel, layer_ids: Sequence[int], document_attention: bool
    ) -> None:
        self.model = model
        self.decoder, self.layers = _decoder_of(model)
        self.num_layers = len(self.layers)
        self.layer_ids = validate_layer_ids(layer_ids, self.num_layers)
        self._cache_kw = cache_keyword(model)
        self._captured: dict[int, Tensor] | None = None
        self._stop_after: int | None = None
        self.document_attention = document_attention
        """Packed captures (`position_ids`) attend per document in length groups
        (`target_attention`) instead of transformers' block-diagonal mask: on for CPU targets
        whose every layer is full attention; off keeps transformers' packed path."""
        self.document_groups: int | None = None
        """At most this many length groups of documents per packed capture (None:
        `target_attention.DEFAULT_MAX_GROUPS`)."""
        for i in self.layer_ids:
            self.layers[i].register_forward_hook(self._make_hook(i))

    def _make_hook(self, layer_id: int) -> Callable[[nn.Module, Any, Any], None]:
        def hook(_module: nn.Module, _args: Any, output: Any) -> None:
            if self._captured is None:
                return
            self._captured[layer_id] = _layer_output(output)
            if self._stop_after == layer_id:
                raise _StopForward

        return hook

    @contextmanager
    def _capturing(self, stop_early: bool) -> Iterator[dict[int, Tensor]]:
        self._captured = {}
        self._stop_after = self.layer_ids[-1] if stop_early else None
        try:
            yield self._captured
        finally:
            self._captured = None
            self._stop_after = None

    def _concat(self, captured: dict[int, Tensor]) -> Tensor:
        return torch.cat([captured[i] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def capture(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        *,
        position_ids: Tensor | None = None,
        final: bool = False,
    ) -> Tensor:
        """Hidden states of the capture layers, concatenated in `layer_ids` order.

        Runs only layers 0..max(layer_ids); the rest of the model and the LM head never run.
        With `final`, every layer and the final norm run, and the decoder's last hidden state
        (post-norm: what the LM head reads, so `lm_head` of it is the target's logits) is
        appended as one more hidden_size-wide feature.

        Packed rows (`position_ids` [B, T], restarting at 0 at each document, the padding tail
        counted as one more document; `trainer.pipeline.collate.collate_packed`): each document
        is attended block-diagonally causal and rotated from position 0, so its features equal
        those of the document run alone. That is transformers' packed-sequence path
        (`masking_utils.find_packed_sequence_indices`: a new document wherever a position is not
        its predecessor's + 1), taken when the 2D attention mask is None and there is no cache,
        in every supported version (4.56 on; tested on the floor and the locked version). The
        padding mask is then not passed: the padding tail is a document of its own, which no
        real token sees. With `document_attention` (CPU) the documents are attended per
        document instead (`target_attention`), and when `attention_mask` marks the padding
        tails (0) they are not computed at all: the rows' real tokens run as one flat row (the
        grouped attention does not depend on rows; the MLPs then skip every padding slot, ~4 %
        of a packed micro-batch) and the tails' features are zeros.

        Returns:
            Tensor[B, T, (len(layer_ids) + final) * hidden_size] in the target dtype.
        """
        if position_ids is not None and self.document_attention and attention_mask is not None:
            if position_ids.shape != input_ids.shape or attention_mask.shape != input_ids.shape:
                raise TargetError(
                    f"position_ids {tuple(position_ids.shape)} and attention_mask "
                    f"{tuple(attention_mask.shape)} do not match input_ids "
                    f"{tuple(input_ids.shape)}"
                )
            real = attention_mask.bool().flatten()
            if not bool(real.all()) and bool(real.any()):
                flat_ids, flat_pos = input_ids.flatten()[real], position_ids.flatten()[real]
                feats = self.capture(flat_ids[None], position_ids=flat_pos[None], final=final)
                feats = feats[0]
                out = feats.new_zeros(real.numel(), feats.shape[-1])
                out[real] = feats
                return out.view(*input_ids.shape, feats.shape[-1])
        with self._capturing(stop_early=not final) as captured:
            result: Any = None
            with suppress(_StopForward):
                if position_ids is None:
                    result = self.decoder(
                        input_ids=input_ids, attention_mask=attention_mask, use_cache=False
                    )
                else:
                    if position_ids.shape != input_ids.shape:
                        raise TargetError(
                            f"position_ids {tuple(position_ids.shape)} do not match input_ids "
                            f"{tuple(input_ids.shape)}"
                        )
                    if self.document_attention:
                        result = self._documents_forward(input_ids, position_ids)
                    else:
                        result = self.decoder(
                            input_ids=input_ids, position_ids=position_ids, use_cache=False
                        )
            feats = self._concat(captured)
            if not final:
                return feats
            return torch.cat([feats, result.last_hidden_state], dim=-1)

    def _documents_forward(self, input_ids: Tensor, position_ids: Tensor) -> Any:
        """The decoder on packed rows with `target_attention`'s grouped per-document attention:
        the layout is computed once here, the masks are skipped (a prepared mask mapping of
        None, which every decoder takes as is) and the attention implementation is switched
        for this call only (not thread-safe on one model: a TargetModel serves one thread).

        `target_attention` is imported here, not at the top: `remote_code` copies this class
        into the export's modeling file, where no trainer package exists; there (spec decoding
        never captures packed rows) this falls back to transformers' packed path.
        """
        try:
            from trainer.model import target_attention
        except ModuleNotFoundError as err:
            if err.name not in ("trainer", "trainer.model"):
                raise
            return self.decoder(input_ids=input_ids, position_ids=position_ids, use_cache=False)
        groups = self.document_groups or target_attention.DEFAULT_MAX_GROUPS
        layout = target_attention.document_layout(position_ids, max_groups=groups)
        layout = target_attention.layout_to(layout, input_ids.device)
        config = self.model.config
        before = config._attn_implementation
        config._attn_implementation = target_attention.ATTENTION_NAME
        try:
            return self.decoder(
                input_ids=input_ids,
                attention_mask={"full_attention": None},
                position_ids=position_ids,
                use_cache=False,
                **{target_attention.LAYOUT_KWARG: layout},
            )
        finally:
            config._attn_implementation = before

    @torch.no_grad()
    def forward_with_capture(
        self,
        input_ids: Tensor,
        *,
        cache: DynamicCache | None = None,
        attention_mask: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Full forward (logits for every position) that also returns the captured features.

        Used by the speculative decoding loop, where one verify forward both checks the draft
        and yields the features of the tokens it commits. `cache` is an HF cache object that
        the call extends in place.

        Returns:
            (logits [B, T, V] float32, features [B, T, len(layer_ids) * H])
        """
        with self._capturing(stop_early=False) as captured:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                use_cache=cache is not None,
                **{self._cache_kw: cache},
            )
            return out.logits.float(), self._concat(captured)


class TargetModel(LayerCapture):
    """A frozen causal LM plus forward hooks on the decoder layers in `layer_ids`.

    `embed_tokens` and `lm_head` are the target's own modules (no copies), shared with the
    drafter; every parameter has `requires_grad=False`.
    """

    def __init__(self, model: PreTrainedModel, layer_ids: Sequence[int]) -> None:
        model.train(False)  # eval(); transformers leaves eval unannotated
        model.requires_grad_(False)
        self.embed_tokens = _own_module(
            model, model.get_input_embeddings(), nn.Embedding, "the input embedding"
        )
        head = model.get_output_embeddings()  # type: ignore[no-untyped-call]  # unannotated in transformers
        self.lm_head = _own_module(model, head, nn.Linear, "the LM head")
        self.hidden_size = int(self.embed_tokens.weight.shape[1])
        # Embedding rows (padded vocab), which is what a mask token id must index.
        self.vocab_size = int(self.embed_tokens.weight.shape[0])
        self.config = model.config
        super().__init__(model, layer_ids, self.attends_per_document(self.config, self.device))

    @staticmethod
    def attends_per_document(config: object, device: torch.device | str) -> bool:
        """Whether a target of `config` on `device` attends packed documents apart (the
        default of `document_attention`; the step-cost features follow it): on CPU, when
        every layer is full (not sliding-window) attention, as the grouped document attention
        assumes; a config without `layer_types` does not say, so it is not assumed. (On the
        class, not a module function: `remote_code` copies this class into the export alone.)"""
        types = getattr(config, "layer_types", None)
        full = isinstance(types, list) and all(t == "full_attention" for t in types)
        return torch.device(device).type == "cpu" and full

    @classmethod
    def load(
        cls,
        path: str | Path,
        layer_ids: Sequence[int] | None = None,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        *,
        num_draft_layers: int | None = None,
    ) -> TargetModel:
        """Load a local HF causal LM directory (never the hub), frozen, in eval mode.

        Args:
            path: directory written by `save_pretrained`.
            layer_ids: decoder layers to capture; None derives them with
                `default_target_layer_ids(num_layers, num_draft_layers)`.
            device: where the target runs.
            dtype: None picks bf16 on accelerators and fp32 on CPU.
        """
        path = Path(path)
        if not (path / "config.json").is_file():
            raise TargetError(f"{path}: not a model directory (no config.json)")
        try:
            model = load_causal_lm(path, dtype or default_dtype(device))
        except Exception as err:  # safetensors, torch and HF raise their own types
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise TargetError(f"{path}: cannot load target model: {first}") from err
        # transformers types `to` through a decorator as if `self` were the argument.
        model.to(device)  # type: ignore[arg-type]  # outside the load lock: copies may overlap
        if layer_ids is None:
            if num_draft_layers is None:
                raise TargetError("give layer_ids or num_draft_layers")
            layer_ids = default_target_layer_ids(len(_decoder_of(model)[1]), num_draft_layers)
        return cls(model, layer_ids)

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    @property
    def feature_size(self) -> int:
        """Width of one captured position: len(layer_ids) * hidden_size."""
        return len(self.layer_ids) * self.hidden_size

    def new_cache(self) -> DynamicCache:
        """An empty KV cache for `forward_with_capture`."""
        return DynamicCache(config=self.config)

    @staticmethod
    def crop_cache(cache: DynamicCache, length: int) -> None:
        """Drop cached positions >= `length` (rejected draft tokens after a verify step)."""
        have = cache.get_seq_length()
        if have < length:
            raise ValueError(f"cannot crop a cache of {have} to {length}")
        if have > length:
            # A negative count (transformers 5 takes no other); never crop(-0), which
            # transformers 4.x reads as crop(0), "keep 0 positions".
            cache.crop(length - have)

    def logits(self, input_ids: Tensor, cache: DynamicCache) -> Tensor:
        """Logits [B, T, V] of a forward that extends `cache` in place (greedy decoding)."""
        out = self.model(input_ids=input_ids, use_cache=True, **{self._cache_kw: cache})
        logits: Tensor = out.logits
        return logits
