"""One host's run as it is now: the status snapshot, the deployed and checkpointed configs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from dflashctl.config.inventory import HostConfig, InventoryError
from dflashctl.remote.files import read_file
from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.run import status_argv
from dflashctl.remote.tmux import PaneState, parse_pane_state, tmux_settled_pane_state
from dflashctl.remote.transport import (
    CommandResult,
    HostUnreachable,
    Transport,
    TransportError,
)
from dflashctl.runs.snapshot import RunStatus, parse_status
from trainer.events import sanitize_for_terminal

if TYPE_CHECKING:
    from dflashctl.releases.resume import CheckpointConfig


class RunReader:
    """Reads one host's run through a Transport (SSH+pct or local); changes nothing."""

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        self.transport = transport
        self.host = host
        self.layout = RemoteLayout(host.workdir)

    async def _run(
        self, argv: list[str], *, timeout: float | None = None, input: bytes | None = None
    ) -> CommandResult:
        # timeout None: the transport's own default, the host's command_timeout.
        return await self.transport.run(argv, timeout=timeout, input=input)

    async def pane_state(self) -> PaneState | None:
        """The pane's state once tmux has its exit status (one round trip); None: no session."""
        res = await self._run(tmux_settled_pane_state(self.host.session))
        return parse_pane_state(res.stdout) if res.ok else None

    async def status(self, *, setup_errors: bool = False) -> RunStatus:
        """Never raises for transport problems: an unreachable host is a state.

        A local SSH setup problem (missing identity file, unreadable known_hosts: an
        InventoryError) is that host's state too, except with `setup_errors`, which the
        single-host commands pass so it reaches the user as the config error it is (exit 2).
        """
        try:
            return await self._status()
        except TransportError as err:
            if setup_errors and isinstance(err, InventoryError):
                raise
            return RunStatus(host=self.host.name, state="unreachable", message=str(err))

    async def status_for(self, operation: str) -> RunStatus:
        """The status `operation` (`start`, `stop`, `logs`) reads before it acts. A host it
        cannot read is that operation's failure, named for it (`start on host pve-a: reading
        the run's status: no answer within 5 s; ...`), not for the status query; a setup
        problem is raised as the config error it is. HostUnreachable (exit 3) either way."""
        try:
            return await self._status()
        except InventoryError:
            raise
        except TransportError as err:
            named = err.during(operation, "reading the run's status")
            if isinstance(named, HostUnreachable):
                raise named from None
            # a status that timed out is an unreachable host here too, as `status` reports it
            raise HostUnreachable(str(named), hint=named.hint) from None

    async def _status(self) -> RunStatus:
        from dflashctl.config.runconfig import config_hash_of_text

        res = await self._run(status_argv(self.host.workdir, self.host.session))
        if not res.ok:
            msg = res.error_line()
            if "not running" in msg:
                msg = f"container {self.host.ctid} is not running (pct start {self.host.ctid})"
            msg = sanitize_for_terminal(msg)
            raise HostUnreachable(f"{self.host.name}: {msg}", label=self.host.name, detail=msg)
        return parse_status(
            self.host.name, res.stdout, config_hash_of_text, session=self.host.session
        )

    async def deployed_config(self) -> str:
        res = await self._run(read_file(self.layout.config))
        return res.stdout if res.ok else ""

    async def checkpoint_config(self, resume: str = "auto") -> CheckpointConfig | None:
        """The config saved in the checkpoint a resume would load (None: cannot tell)."""
        from dflashctl.releases.resume import read_checkpoint_config

        return await read_checkpoint_config(self.transport, self.host, resume)
