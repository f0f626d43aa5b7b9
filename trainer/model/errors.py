"""The model side's user errors, torch-free: a CLI can catch them (and check inputs that raise
them) before torch or transformers load."""

from __future__ import annotations

from trainer.errors import TrainerError


class TargetError(TrainerError, ValueError):
    """A target directory or layer selection that cannot work (message names the culprit)."""


class ExportError(TrainerError, ValueError):
    """An export directory that cannot be read back (message names the file)."""
