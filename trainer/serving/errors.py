"""Errors of the serving side: one line naming the engine's URL (or its log)."""

from __future__ import annotations

from trainer.errors import ExitCode, TrainerError


class EngineError(TrainerError):
    """The engine refused a request, answered something unreadable, or would not start."""

    exit_code = ExitCode.FAILED


class EngineGone(EngineError):
    """The engine stopped answering mid-run (connection refused, reset or timed out)."""
