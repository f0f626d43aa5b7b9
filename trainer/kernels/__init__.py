"""Kernels for the drafter's loss: fused LM-head + cross-entropy with torch fallbacks.

`lm_head_cross_entropy` is the entry point of the hard-label CE (`trainer.kernels.lm_head_ce`);
`lm_head_distill_cross_entropy` that of logit distillation (soft-label CE, and the hard CE from
the same pass; `lm_head_soft_cross_entropy` the soft part alone; `trainer.kernels.distill`).
"""

from trainer.kernels.common import BackendUnavailableError, KernelInputError, LMHeadCE
from trainer.kernels.distill import (
    DistillCE,
    lm_head_distill_cross_entropy,
    lm_head_soft_cross_entropy,
)
from trainer.kernels.lm_head_ce import lm_head_cross_entropy, select_backend

__all__ = [
    "BackendUnavailableError",
    "DistillCE",
    "KernelInputError",
    "LMHeadCE",
    "lm_head_cross_entropy",
    "lm_head_distill_cross_entropy",
    "lm_head_soft_cross_entropy",
    "select_backend",
]
