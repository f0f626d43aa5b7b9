"""Learning-rate schedule: linear warmup, then cosine decay to a floor.

The LR of optimizer step s (0-based) is applied *before* step s runs, so step 0 trains with
peak/warmup, never with the peak (the seed run printed lr=6.00e-04 at step 0: warmup was skipped).
"""

from __future__ import annotations

import math


def warmup_steps_for(total_steps: int, warmup_steps: int | None, warmup_ratio: float | None) -> int:
    """Explicit warmup steps win; else a ratio of the whole run (0 when neither is set)."""
    if warmup_steps is not None:
        return min(warmup_steps, total_steps)
    if warmup_ratio:
        return min(max(1, round(warmup_ratio * total_steps)), total_steps)
    return 0


def lr_at(step: int, *, total_steps: int, warmup_steps: int, peak: float, floor: float) -> float:
    """LR for optimizer step `step` of `total_steps`: (s+1)/W * peak in warmup, cosine after.

    Past the end it stays at the floor (a run extended by max_steps never trains at lr < floor).
    """
    if step < warmup_steps:
        return peak * (step + 1) / warmup_steps
    decay = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay)
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
