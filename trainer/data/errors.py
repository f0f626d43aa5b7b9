"""User-caused data errors: the CLI prints the one-line message and exits 2."""

from __future__ import annotations

from trainer.errors import TrainerError


class InputError(TrainerError):
    """Bad input file, tokenizer directory or option; the message names the file or key."""
