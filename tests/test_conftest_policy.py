"""The skip-or-fail policy itself: a real-parts test must not silently skip in CI."""

import pytest

from tests import conftest


def test_require_part_passes_when_available() -> None:
    conftest.require_part(True, "unused")


def test_require_part_fails_in_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="sshd missing"):
        conftest.require_part(False, "sshd missing")


def test_require_part_skips_locally(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(conftest, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match="sshd missing"):
        conftest.require_part(False, "sshd missing")
