"""Verify-step counting protocols of speculative decoding (`trainer.model.speculative`),
torch-free so a CLI can offer them as choices before torch loads."""

from __future__ import annotations

from typing import Literal

Protocol = Literal["exact", "zlab"]
PROTOCOLS: tuple[Protocol, ...] = ("exact", "zlab")
