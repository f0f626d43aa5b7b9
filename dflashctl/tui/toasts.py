"""What the app says in toasts, and how (pure): a host's news between two states, a failed worker.

The app has two sources of notifications besides its own commands' progress lines: a host's
state gaining a supervisor event or an Xid (`monitor.supervisor_events`, `monitor.xid_events`:
each once, the first poll history), and a worker (a service call) that raised. Both become a
`Toast` here; the app only shows them.
"""

from __future__ import annotations

from dataclasses import dataclass

from textual.notifications import SeverityLevel

from dflashctl.errors import DflashctlError
from dflashctl.monitor.state import RunState, supervisor_events, xid_events

__all__ = ["NEWS_TIMEOUT_S", "SEVERITIES", "WORKER_FAILURES", "Toast", "news", "worker_failure"]

NEWS_TIMEOUT_S = 30.0
"""How long a host's news stays up (a restart, an Xid: worth reading, not worth a click)."""

SEVERITIES: dict[str, SeverityLevel] = {
    "information": "information",
    "warning": "warning",
    "error": "error",
}

WORKER_FAILURES: dict[str, tuple[str, str]] = {
    "restart-plan": ("Restart", "cannot read the deployed config"),
    "stop": ("Stop", "stop failed"),
    "deploy": ("Deploy", "deploy failed"),
    "config": ("Config check", "config check failed"),
    "follow": ("Follow", "following the run failed"),
}
"""Worker group -> (notification title, what failed): how a failed worker is worded. A
worker's name is the host it acts on."""


@dataclass(frozen=True, slots=True)
class Toast:
    """One notification: `App.notify(message, title=, severity=, timeout=)`."""

    message: str
    severity: SeverityLevel = "information"
    title: str = ""
    timeout: float | None = None


def news(old: RunState, new: RunState) -> list[Toast]:
    """A toast per supervisor event and per Xid that `new` adds to `old` (each once)."""
    return [
        Toast(text, SEVERITIES.get(severity, "information"), timeout=NEWS_TIMEOUT_S)
        for severity, text in [*supervisor_events(old, new), *xid_events(old, new)]
    ]


def worker_failure(group: str, name: str | None, error: BaseException | None) -> Toast:
    """`HOST: what failed: why`, titled by what failed (`WORKER_FAILURES`); a DflashctlError
    says its one line (with its hint)."""
    title, what = WORKER_FAILURES.get(group, ("Error", f"{group} failed"))
    why = error.one_line() if isinstance(error, DflashctlError) else str(error)
    host = f"{name}: " if name else ""
    return Toast(f"{host}{what}: {why}", "error", title=title)
