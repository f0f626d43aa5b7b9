"""One host's status.log: read a range, count it, stream it, follow it across dropped links."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from dflashctl.config.inventory import HostConfig
from dflashctl.remote.commands import guarded
from dflashctl.remote.files import line_count, tail_follow, tail_from
from dflashctl.remote.layout import STATUS_LOG, RemoteLayout
from dflashctl.remote.transport import CommandTimeout, Transport
from dflashctl.runs.follow import Backoff, FollowEvent, LogFollower
from dflashctl.runs.service import ControlError
from trainer.events import sanitize_for_terminal

FOLLOW_JITTER = 0.2
"""`follow`'s reconnect delays vary by +-20 %, so many clients of one host do not reconnect in
step."""


class RunLog:
    """run/status.log of one host, read through a Transport."""

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        self.transport = transport
        self.host = host
        self.layout = RemoteLayout(host.workdir)

    async def log_tail(self, from_line: int) -> list[str]:
        """run/status.log from 0-based `from_line`, made safe to print."""
        res = await self.transport.run(tail_from(self.layout.status_log, from_line))
        if not res.ok and "No such file" not in res.stderr:
            raise ControlError(f"{self.host.name}: reading {STATUS_LOG}: {res.error_line()}")
        return sanitize_for_terminal(res.stdout).splitlines()

    async def log_line_count(self) -> int | None:
        """Lines in run/status.log now: 0 when it is gone, None when it cannot be told (a
        command timeout, an unreadable answer). A follower compares it with the lines it has
        read to see that the log started over."""
        try:
            res = await self.transport.run(line_count(self.layout.status_log))
        except CommandTimeout:
            return None  # unknown: keep the count (the tail itself will show what is wrong)
        if not res.ok:
            return 0 if "No such file" in res.stderr else None
        count = res.stdout.split()[:1]  # "N path"
        return int(count[0]) if count and count[0].isdigit() else None

    async def tail_log(self, from_line: int) -> AsyncGenerator[str, None]:
        """One connection's `tail -F` of run/status.log from 0-based `from_line`, made safe to
        print (the one reader of the live log).

        Only newline-terminated lines are delivered, so the count of lines received is the
        resume point. It ends when the stream ends and raises TransportError (HostUnreachable,
        HostKeyError) when the link drops; reconnecting is the caller's (dflashctl.runs.follow).
        """
        path = self.layout.status_log
        async for line in self.transport.stream_lines(guarded(tail_follow(path, from_line))):
            yield sanitize_for_terminal(line)

    def follow(
        self,
        from_line: int = 0,
        *,
        delay: Callable[[int], float] | None = None,
        max_attempts: int | None = None,
    ) -> AsyncGenerator[FollowEvent, None]:
        """status.log from 0-based `from_line`, forever, across dropped links, as the one follow
        loop's typed events (`dflashctl.runs.follow`): no line repeated or skipped on a reconnect,
        a log that started over read again from its first line. `delay` defaults to a
        jittered backoff."""
        follower = LogFollower(
            self,
            from_line,
            delay=delay or Backoff(jitter=FOLLOW_JITTER).delay,
            max_attempts=max_attempts,
            name=self.host.name,
        )
        return follower.events()
