"""Sending the watch's notifications through apprise, to URLs read from a private file.

The URLs carry tokens (a Slack webhook *is* its secret), so they live only in the file the
inventory names (`notify_urls_file`): never on a command line, never in hosts.toml, and never
in a log line or an error message. A target is named by its place: `FILE line N (scheme)`.

`load_targets(path)` reads the file (one URL per line, `#` comments, blank lines ignored);
a file others can read or write, a missing file or a file with no URLs raises
`NotifyConfigError`; each bad line is one entry in the returned error list (all of them, so one
fix-up pass suffices). `Notifier.send(notification)` sends to every target, retries a failing
target with growing backoff, logs each failure redacted, and never raises: the watch must not
stop because a push service is down.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import apprise

from dflashctl.alerts.policy import Notification
from dflashctl.errors import UsageError

__all__ = [
    "Notifier",
    "NotifyConfigError",
    "NotifyTarget",
    "SendReport",
    "load_targets",
]

log = logging.getLogger("dflashctl.alerts.notify")

# apprise logs URLs (and payloads) at debug and hosts at warning, and urllib3 (under requests)
# logs each request's host, port and path, where a webhook keeps its token. Their records must
# never reach a handler of ours (a `watch -v`) or Python's last-resort stderr handler: each call
# runs under a LogCapture (which swallows apprise's), and these loggers do not propagate.
# dflashctl uses none of them for anything else.
for _name in ("apprise", "urllib3", "requests", "requests_oauthlib", "oauthlib"):
    _quiet = logging.getLogger(_name)
    _quiet.propagate = False
    _quiet.addHandler(logging.NullHandler())

_SCHEME_RE = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]{0,31})://")
DEFAULT_BACKOFF_S: tuple[float, ...] = (2.0, 8.0, 30.0)  # waits before attempts 2, 3, 4


class NotifyConfigError(UsageError):
    """The notification URL file cannot be used (one line naming the file)."""


@dataclass(frozen=True)
class NotifyTarget:
    source: str  # the file
    line: int
    scheme: str
    plugin: Any = field(repr=False, compare=False)  # apprise NotifyBase; holds the secret

    @property
    def label(self) -> str:
        return f"{self.source} line {self.line} ({self.scheme})"


def load_targets(path: str | os.PathLike[str]) -> tuple[list[NotifyTarget], list[str]]:
    """The usable targets and one error line per bad line (URLs never quoted)."""
    p = Path(path)
    try:
        st = p.stat()
    except OSError as err:
        raise NotifyConfigError(f"notify_urls_file {p}: cannot read it: {err.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise NotifyConfigError(f"notify_urls_file {p}: not a regular file")
    if st.st_mode & 0o077:
        raise NotifyConfigError(
            f"notify_urls_file {p}: mode {stat.S_IMODE(st.st_mode):04o} lets other users read "
            f"its tokens; chmod 600 {p}"
        )
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as err:
        raise NotifyConfigError(f"notify_urls_file {p}: cannot read it: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise NotifyConfigError(f"notify_urls_file {p}: not UTF-8 (byte {err.start})") from None
    targets: list[NotifyTarget] = []
    errors: list[str] = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _SCHEME_RE.match(line)
        if m is None:
            errors.append(f"{p} line {n}: not a URL (expected scheme://...)")
            continue
        scheme = m.group(1).lower()
        plugin = _instantiate(line)
        if plugin is None:
            errors.append(
                f"{p} line {n}: apprise cannot use this {scheme}:// URL "
                "(unknown service or a malformed URL; see apprise's URL docs)"
            )
            continue
        targets.append(NotifyTarget(str(p), n, scheme, plugin))
    if not targets and not errors:
        raise NotifyConfigError(f"notify_urls_file {p}: holds no URLs")
    return targets, errors


def _instantiate(url: str) -> Any:
    with apprise.LogCapture(level=logging.DEBUG):  # type: ignore[no-untyped-call]  # apprise leaves it unannotated
        try:
            return apprise.Apprise.instantiate(url, suppress_exceptions=True)
        except Exception:
            return None


@dataclass(frozen=True)
class SendReport:
    delivered: tuple[str, ...]  # target labels
    failed: tuple[str, ...]
    attempts: int

    @property
    def ok(self) -> bool:
        return not self.failed


class Notifier:
    """Sends notifications to every target; retries with backoff; never raises."""

    def __init__(
        self,
        targets: Sequence[NotifyTarget],
        *,
        backoff_s: Sequence[float] = DEFAULT_BACKOFF_S,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.targets = list(targets)
        self.backoff_s = tuple(backoff_s)
        self._sleep = sleep

    def send(self, n: Notification) -> SendReport:
        delivered: list[str] = []
        failed: list[str] = []
        attempts = 0
        for t in self.targets:
            ok = False
            tries = 1 + len(self.backoff_s)
            for attempt in range(1, tries + 1):
                attempts += 1
                why = self._send_once(t, n)
                if why is None:
                    ok = True
                    break
                if attempt < tries:
                    wait = self.backoff_s[attempt - 1]
                    log.warning(
                        "notification to %s failed (%s), attempt %d of %d; retrying in %g s",
                        t.label, why, attempt, tries, wait,
                    )  # fmt: skip
                    with contextlib.suppress(Exception):  # an interrupted wait: retry now
                        self._sleep(wait)
                else:
                    log.error(
                        "notification to %s failed (%s) after %d attempts; dropped: %s",
                        t.label, why, tries, n.title,
                    )  # fmt: skip
            (delivered if ok else failed).append(t.label)
        return SendReport(tuple(delivered), tuple(failed), attempts)

    @staticmethod
    def _send_once(t: NotifyTarget, n: Notification) -> str | None:
        """None when delivered, else a reason that names no part of the URL."""
        with apprise.LogCapture(level=logging.DEBUG):  # type: ignore[no-untyped-call]  # apprise leaves it unannotated
            try:
                a = apprise.Apprise()
                a.add(t.plugin)
                result = a.notify(body=n.body, title=n.title, notify_type=n.severity)
            except Exception as err:  # apprise suppresses most; a plugin bug must not escape
                return f"{type(err).__name__}"
        return None if result else "the service refused it or could not be reached"
