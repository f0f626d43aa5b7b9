"""Token store, chat-JSONL import and synthetic data (`python -m trainer.data import|synth|info|show`).

Importing this package is cheap and torch-free; the tokenizer stack (transformers) is loaded only
by the `import` command.
"""

from trainer.data.store import Manifest, StoreError, StoreWriter, TokenStore

__all__ = ["Manifest", "StoreError", "StoreWriter", "TokenStore"]
