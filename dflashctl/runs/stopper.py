"""Stopping one host's trainer gracefully: SIGINT, wait for its checkpoint line, then clear."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from dflashctl.remote.files import tail_from
from dflashctl.remote.run import stop_wait_argv
from dflashctl.remote.tmux import tmux_capture, tmux_interrupt, tmux_kill_session
from dflashctl.remote.transport import CommandResult
from dflashctl.runs.reader import RunReader
from dflashctl.runs.service import LIVE_STATES, ControlError, StopResult
from dflashctl.runs.snapshot import parse_events
from trainer.events import CheckpointEvent, ErrorEvent


def interrupt_children(pid: int) -> list[str]:
    """SIGINT to every child of `pid` (a group node's torchrun: its trainer ranks)."""
    return ["pkill", "-INT", "-P", str(int(pid))]


def kill_if_childless(pid: int) -> list[str]:
    """SIGKILL `pid` unless it still has children (a torchrun whose ranks all exited)."""
    # without pgrep nothing is known of its children: then nothing is killed
    script = 'command -v pgrep >/dev/null && ! pgrep -P "$1" >/dev/null && kill -KILL "$1"'
    return ["sh", "-c", script, "kill-if-childless", str(int(pid))]


def _error_after(log_text: str, capture: str) -> str | None:
    """The trainer's last ERROR line since the interrupt: status.log past the mark, else the
    pane's (a full disk stops status.log first)."""
    for text in (log_text, capture):
        errors = [e for e in parse_events(text) if isinstance(e, ErrorEvent)]
        if errors:
            return errors[-1].message
    return None


class RunStopper:
    """Stops one host's trainer (or its part of a group) and reports its last checkpoint."""

    def __init__(self, reader: RunReader) -> None:
        self.reader = reader
        self.transport = reader.transport
        self.host = reader.host
        self.layout = reader.layout

    async def _run(
        self, argv: list[str], *, timeout: float | None = None, input: bytes | None = None
    ) -> CommandResult:
        # timeout None: the transport's own default, the host's command_timeout.
        return await self.transport.run(argv, timeout=timeout, input=input)

    async def stop(self, timeout: float = 120.0) -> StopResult:
        """SIGINT, wait for the checkpoint line (or exit) up to `timeout`, then kill the session.

        The C-c reaches the pane's process: the supervisor forwards it to the trainer once (a
        graceful stop, never restarted) or, in a restart backoff, exits without another attempt.
        """
        return await self._stop(timeout)

    async def stop_node(
        self,
        timeout: float = 120.0,
        *,
        settle_s: float = 0.0,
        interrupt: bool = True,
        after_interrupt: Callable[[], Awaitable[None]] | None = None,
        supervised: bool = False,
    ) -> StopResult:
        """Stop this host's part of a group, as `stop` does, except:

        Under the node's supervisor (`supervised`) the C-c goes to it, as on a single host: it
        records an operator stop (nothing is restarted) and forwards the SIGINT once to its
        torchrun, which passes it once to each rank. A bare torchrun's pane: SIGINT goes to
        the pane process's children, the trainer ranks, not to torchrun, which would pass a
        second SIGINT on (a stop at once, no checkpoint). Either way the ranks' stop is agreed
        in the step's reduce, so they stop at the same step.
        `settle_s`: after the checkpoint line, wait up to this long more for the pane's
        process to exit by itself (torchrun meets its peers at an exit barrier: ending its
        session before would fail the other nodes' agents and leave this one holding its
        rendezvous port while it shuts down). `interrupt=False`: the ranks were signalled
        already (a group's other nodes): only wait and clear. `after_interrupt` runs right
        after this node's SIGINT, before the wait (a group signals its other nodes there).
        """
        return await self._stop(
            timeout,
            workers=not supervised,
            settle_s=settle_s,
            interrupt=interrupt,
            after_interrupt=after_interrupt,
        )

    async def _stop(
        self,
        timeout: float,
        *,
        workers: bool = False,
        settle_s: float = 0.0,
        interrupt: bool = True,
        after_interrupt: Callable[[], Awaitable[None]] | None = None,
    ) -> StopResult:
        st = await self.reader.status_for("stop")
        if st.state not in LIVE_STATES:
            if st.exit_status is not None:
                await self._run(tmux_kill_session(self.host.session))
            return StopResult(
                self.host.name,
                False,
                None,
                "dead" if st.exit_status is not None else "not-running",
                st.exit_status,
            )
        mark = st.log_lines
        if workers and interrupt:
            await self.interrupt_workers()
        elif not workers and interrupt:
            await self.interrupt_pane()
        if after_interrupt is not None:
            await after_interrupt()
        waited = await self._run(
            stop_wait_argv(self.host.workdir, self.host.session, mark, timeout),
            timeout=timeout + 30,
        )
        outcome = (waited.stdout.strip().splitlines() or ["timeout"])[-1]
        if outcome == "checkpointed" and settle_s > 0:
            # the same wait past the log's end: it ends only when the pane's process exits
            settled = await self._run(
                stop_wait_argv(self.host.workdir, self.host.session, 10**9, settle_s),
                timeout=settle_s + 30,
            )
            if (settled.stdout.strip().splitlines() or [""])[-1] == "exited":
                outcome = "exited"
        log = await self._run(tail_from(self.layout.status_log, mark))
        cap = await self._run(tmux_capture(self.host.session, 300))
        # Only checkpoints written after the interrupt count: status.log lines past the mark, or
        # (trainers that only print) pane lines newer than the last checkpoint known before it.
        before = st.last_checkpoint.step if st.last_checkpoint else -1
        ckpts = [
            e for e in parse_events(log.stdout if log.ok else "") if isinstance(e, CheckpointEvent)
        ]
        if not ckpts:
            pane_events = parse_events(cap.stdout if cap.ok else "")  # -J: rows already joined
            ckpts = [e for e in pane_events if isinstance(e, CheckpointEvent) and e.step > before]
        state = await self.reader.pane_state()
        if workers and state is not None and not state.dead and state.pid is not None:
            # torchrun outlived its ranks (stuck at its exit barrier: a peer's agent failed);
            # ending the session alone would not end it (it handles SIGHUP only between
            # waits) and it would hold the rendezvous port: killed, once it has no ranks left
            await self._run(kill_if_childless(state.pid))
        await self._run(tmux_kill_session(self.host.session))
        best = max(ckpts, key=lambda e: e.step) if ckpts else None
        error = None if best else _error_after(log.stdout if log.ok else "", cap.stdout)
        return StopResult(
            self.host.name,
            True,
            best,
            outcome,
            state.exit_status if state and state.dead else None,
            error,
            in_backoff=st.state == "restarting",
        )

    async def interrupt_pane(self) -> None:
        """C-c in the pane: its foreground process (the supervisor) gets one SIGINT."""
        sent = await self._run(tmux_interrupt(self.host.session))
        if not sent.ok:
            raise ControlError(f"{self.host.name}: sending C-c: {sent.error_line()}")

    async def interrupt_workers(self) -> None:
        """SIGINT to the pane process's children (a group node's torchrun: its ranks)."""
        pane = await self.reader.pane_state()
        if pane is None or pane.pid is None or pane.dead:
            return
        sent = await self._run(interrupt_children(pane.pid))
        # pkill's 1: no child (the ranks exited meanwhile): the stop's wait sees the exit
        if sent.rc not in {0, 1}:
            raise ControlError(f"{self.host.name}: SIGINT to the ranks: {sent.error_line()}")
