"""Suite-wide test policy.

Tests that need real parts (sshd, LXC, tmux, the trainer's torch stack) call `require_part`.
Locally a missing part skips the test with the reason; with CI=true it fails, because a skipped
real-parts test in CI would make a green run lie.
"""

from __future__ import annotations

import os

import pytest

IN_CI = os.environ.get("CI", "").lower() in {"1", "true", "yes"}


def require_part(available: bool, reason: str) -> None:
    """Skip (locally) or fail (in CI) when a real part the test needs cannot be started."""
    if available:
        return
    if IN_CI:
        pytest.fail(f"CI=true and a required part is unavailable: {reason}", pytrace=False)
    pytest.skip(reason)
