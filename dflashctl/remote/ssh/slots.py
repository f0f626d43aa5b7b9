"""Channel slots of one SSH connection: at most the host's max_channels channels at once.

sshd keeps a session, and its slot under MaxSessions, until the command behind it exits,
whatever the client does with the channel; so a slot is given back only once sshd has closed
the channel, and polling, a live `logs -f` and timed-out commands never run the node out of
sessions. A fresh connection has all its sessions: `reset` starts a new count for it.
"""

from __future__ import annotations

import asyncio
import contextlib

import asyncssh

from dflashctl.config.inventory import HostConfig
from dflashctl.remote.ssh.options import LINK_ERRORS
from dflashctl.remote.transport import CommandTimeout

Slot = asyncio.Semaphore
"""A taken slot: the count it was taken from (a reset does not give it back to the new one)."""


class ChannelSlots:
    def __init__(self, host: HostConfig) -> None:
        self.host = host
        self._slots = asyncio.Semaphore(host.max_channels)
        self._reapers: set[asyncio.Task[None]] = set()

    def reset(self) -> None:
        """A new connection: slots still held by channels of a dropped one do not count."""
        self._slots = asyncio.Semaphore(self.host.max_channels)

    def all_taken(self) -> bool:
        """No slot free now: every channel is held by a command sshd has not closed."""
        return self._slots.locked()

    async def take(self, what: str, limit: float, left: float | None = None) -> Slot:
        """Take one slot within `left` (default `limit`) seconds; CommandTimeout if none frees."""
        slots = self._slots
        try:
            await asyncio.wait_for(slots.acquire(), limit if left is None else max(0.0, left))
        except TimeoutError:
            raise CommandTimeout.of_command(
                what,
                self.host.name,
                f"not started within {limit:g} s: all {self.host.max_channels} SSH channels to "
                f"{self.host.address} are in use (max_channels) by commands still running there",
            ) from None
        return slots

    def release_when_closed(
        self, proc: asyncssh.SSHClientProcess[bytes] | None, slot: Slot
    ) -> None:
        """Give the slot back once sshd has closed the channel (its session is then free)."""
        if proc is None:
            slot.release()
            return
        if proc.exit_status is None and proc.exit_signal is None:
            # Abandoned (timed out, cancelled): ask sshd to end it (TERM reaches `timeout`,
            # which passes it on to the whole group; sshd without privilege separation refuses,
            # and the node-side bound ends it anyway), then close our side.
            with contextlib.suppress(*LINK_ERRORS):
                proc.send_signal("TERM")
            proc.close()

        async def reap() -> None:
            try:
                with contextlib.suppress(*LINK_ERRORS):
                    await proc.wait_closed()
            finally:
                slot.release()

        task = asyncio.get_running_loop().create_task(reap())
        self._reapers.add(task)
        task.add_done_callback(self._reapers.discard)

    def close(self) -> None:
        """Stop waiting for abandoned channels (the connection is closed)."""
        for task in list(self._reapers):
            task.cancel()
        self._reapers.clear()
