"""Numbers for people, shared by every layer that prints them (pure)."""

from __future__ import annotations


def format_age(seconds: float | None) -> str:
    """Compact age: 4s, 2m05s, 3h12m, 2d04h; an em dash when there is none."""
    if seconds is None:
        return "—"
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{(s % 3600) // 60:02d}m"
    return f"{s // 86400}d{(s % 86400) // 3600:02d}h"
