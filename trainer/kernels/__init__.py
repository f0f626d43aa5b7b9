"""Kernels for the drafter's loss: fused LM-head + cross-entropy with torch fallbacks.

`lm_head_cross_entropy` is the only entry point callers need; see `trainer.kernels.lm_head_ce`.
"""

from trainer.kernels.common import BackendUnavailableError, KernelInputError, LMHeadCE
from trainer.kernels.lm_head_ce import lm_head_cross_entropy, select_backend

__all__ = [
    "BackendUnavailableError",
    "KernelInputError",
    "LMHeadCE",
    "lm_head_cross_entropy",
    "select_backend",
]
