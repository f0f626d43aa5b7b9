"""Suite-wide test policy.

Tests that need real parts (sshd, LXC, tmux, the trainer's torch stack) call `require_part`.
Locally a missing part skips the test with the reason; with CI=true it fails, because a skipped
real-parts test in CI would make a green run lie.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require_part(available: bool, reason: str) -> None:
    """Skip (locally) or fail (in CI) when a real part the test needs cannot be started."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a required part is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def qwen3_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the real Qwen3 tokenizer (unpacked from tests/fixtures once)."""
    from tests.fixtures.qwen3 import unpack_qwen3_tokenizer

    return unpack_qwen3_tokenizer(tmp_path_factory.mktemp("qwen3-tokenizer"))
