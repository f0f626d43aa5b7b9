"""What a checkpoint file must hold, for the two sides that read one.

The trainer (`trainer.pipeline.checkpoint`, torch) writes and loads checkpoints; dflashctl
(`dflashctl.releases.resume`, torch-free) looks inside one on the node to say which checkpoint a resume
would use. Both skip the same files because both take these names from here.
"""

from __future__ import annotations

CHECKPOINT_VERSION = 1
REQUIRED_KEYS: tuple[str, ...] = (
    "step",
    "micro",
    "world_size",
    "config",
    "drafter",
    "optimizer",
    "sampler",
    "rng",
    "counters",
)
