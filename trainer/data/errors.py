"""User-caused data errors: the CLI prints the one-line message and exits 2."""

from __future__ import annotations


class InputError(Exception):
    """Bad input file, tokenizer directory or option; the message names the file or key."""
