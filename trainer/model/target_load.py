"""Load a local Hugging Face causal LM in a dtype without touching torch's process-wide default.

transformers builds a model under `torch.set_default_dtype(dtype)`. That default is one value for
the whole process, so while a bf16 load was in flight every other thread's `torch.rand` or
`torch.zeros` came out bf16 (a prefetch or drafter thread, the pipeline's other target workers).
Here the model is built under a torch function mode instead, which is per thread (as
`torch.device("meta")`'s is): only the loading thread's factory calls take `dtype`.
`from_pretrained` is asked for the process's own default, so it sets the default to the value it
already has, which no other thread can tell apart; it casts each checkpoint tensor to the dtype of
the parameter it built (transformers 4.56 and 5 both do), so the weights land in `dtype` directly
and peak host memory stays one copy of the model in `dtype`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

_LOAD_LOCK = threading.Lock()
"""One `load_causal_lm` at a time: transformers swaps other process-wide state while it builds a
model (5.x replaces `torch.linspace` for the duration; two loads in flight restore each other's
replacement as "the original"), and one load at a time bounds peak host memory to one model."""

_FLOAT_FACTORIES = frozenset(
    {
        torch.empty,
        torch.empty_strided,
        torch.zeros,
        torch.ones,
        torch.rand,
        torch.randn,
        torch.eye,
        torch.linspace,
        torch.logspace,
    }
)
"""Factories whose result, without a `dtype=`, is always in torch's default float dtype."""


def _takes_default_float(
    func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
) -> bool:
    """Whether `func(*args, **kwargs)` would be in the default float dtype for want of a `dtype=`:
    the float factories, `full` with a float fill and `arange` with a float bound. (Tensors made
    from Python data, `torch.tensor(0.5)`, keep the process default: transformers' models build
    their parameters and buffers with the factories above.)"""
    if kwargs.get("dtype") is not None:
        return False
    if func in _FLOAT_FACTORIES:
        return True
    if func is torch.full:
        fill = args[1] if len(args) > 1 else kwargs.get("fill_value")
        return isinstance(fill, float)
    if func is torch.arange:
        bounds = [*args, *(kwargs.get(k) for k in ("start", "end", "step"))]
        return any(isinstance(b, float) for b in bounds)
    return False


class _FloatDefault(TorchFunctionMode):
    """In the thread that enters it, factory calls that would take torch's default float dtype
    take `dtype`; `torch.get_default_dtype()` and every other thread are left alone."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Collection[type],
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = dict(kwargs or {})
        if _takes_default_float(func, args, kwargs):
            kwargs["dtype"] = self.dtype
        return func(*args, **kwargs)


def load_causal_lm(path: Path, dtype: torch.dtype) -> PreTrainedModel:
    """The causal LM saved in `path` (local files only, SDPA attention), its floating parameters in
    `dtype`, built without changing the process default dtype. Raises what transformers, torch or
    safetensors raise."""
    with _LOAD_LOCK, _FloatDefault(dtype):
        AutoConfig.from_pretrained(path, local_files_only=True)
        model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
            path,
            dtype=torch.get_default_dtype(),
            local_files_only=True,
            attn_implementation="sdpa",
        )
    model.config.dtype = dtype  # what the weights are, as a from_pretrained(dtype=dtype) says
    return model
