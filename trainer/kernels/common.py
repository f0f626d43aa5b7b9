"""Result type and errors shared by every LM-head cross-entropy backend."""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

Backend = Literal["auto", "triton", "chunked", "dense"]
BACKENDS: tuple[str, ...] = ("auto", "triton", "chunked", "dense")


class LMHeadCE(NamedTuple):
    """Per-position results; ignored positions have loss 0 and correct False."""

    loss: torch.Tensor  # [N] float32, differentiable w.r.t. hidden
    correct: torch.Tensor  # [N] bool: argmax over the vocabulary == label


class KernelInputError(ValueError):
    """A caller passed tensors the kernel cannot use (shape, dtype, device, label range)."""


class BackendUnavailableError(RuntimeError):
    """An explicitly requested backend cannot run on this machine or for these tensors."""
