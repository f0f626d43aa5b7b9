"""Starting one host's trainer: under its supervisor in tmux, and waiting until it is set up.

The trainer runs in tmux on a private socket (`-L dflash`), session name from the inventory,
exact-match targets, remain-on-exit (a crash leaves a dead pane with its exit status). It is
started against a resolved release directory, not the `current` symlink, so a deploy while it
runs never swaps code under it; `run/.release` records which release that is (deploy never
prunes it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from dflashctl.config.runconfig import RunConfigError, drafter_device_count
from dflashctl.remote.commands import supervised
from dflashctl.remote.files import read_file, write_file_atomic
from dflashctl.remote.release import acknowledge_switch
from dflashctl.remote.run import (
    TORCHRUN_MODULE,
    host_trainer_argv,
    start_wait_argv,
    trainer_argv,
)
from dflashctl.remote.tmux import (
    parse_pane_state,
    tmux_capture,
    tmux_kill_session,
    tmux_new_session,
    tmux_settled_pane_state,
)
from dflashctl.remote.transport import CommandResult
from dflashctl.runs.logs import RunLog
from dflashctl.runs.reader import RunReader
from dflashctl.runs.service import (
    DEFAULT_START_WAIT_S,
    LIVE_STATES,
    ControlError,
    StartFailed,
    StartResult,
    job_refusal,
    measure_refusal,
)
from dflashctl.runs.snapshot import (
    describe_exit,
    last_error_line,
    pane_signal,
    pane_supervisor,
    parse_supervisor_file,
)
from trainer.events import sanitize_for_terminal

TORCHRUN_SHUTDOWN_TIMEOUT_S = 600
"""How long torchrun waits for its ranks after forwarding a stop before it SIGKILLs them."""


def rank_count(config_text: str) -> int:
    """The ranks the deployed config needs on this host; 1 when it does not validate here (the
    trainer names the problem itself, as it did before torchrun starts existed)."""
    try:
        return drafter_device_count(config_text) if config_text else 1
    except RunConfigError:
        return 1


@dataclass(frozen=True)
class NodeCommand:
    """What a group node's pane runs: its supervisor's flags (the group's policy and the node's
    index) in front of the group's torchrun argv, the env it adds, and whether the run starts
    fresh (no rank count of this host's own)."""

    argv: list[str]
    env: dict[str, str]
    fresh: bool
    supervisor: list[str] | None = None  # None: bare torchrun (a test's stand-in)


class RunStarter:
    """Starts one host's trainer (or its part of a group) and tells a failed start."""

    def __init__(self, reader: RunReader, log: RunLog) -> None:
        self.reader = reader
        self.log = log
        self.transport = reader.transport
        self.host = reader.host
        self.layout = reader.layout

    async def _run(
        self, argv: list[str], *, timeout: float | None = None, input: bytes | None = None
    ) -> CommandResult:
        # timeout None: the transport's own default, the host's command_timeout.
        return await self.transport.run(argv, timeout=timeout, input=input)

    async def start(
        self,
        *,
        fresh: bool = False,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Callable[[str], None] | None = None,
    ) -> StartResult:
        """Start the trainer and wait (up to `wait_s`) until it is past its setup or has exited.

        The trainer runs under the in-container supervisor (`python -m trainer.supervise`) with
        the host's restart policy, when the release ships it (an older release runs bare, with
        a note). A trainer that exits in that time (bad device, a store that is not a store, a
        refused resume) raises StartFailed with its exit status and last error line, also when
        the supervisor is about to restart it: "started" must never be said of a run that is
        already dead. `wait_s=0` skips the wait.
        """
        return await self._start(fresh, resume, wait_s, progress, None)

    async def start_node(
        self,
        node: NodeCommand,
        *,
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Callable[[str], None] | None = None,
    ) -> StartResult:
        """Start this host's part of a group (`dflashctl.groups.launch` builds `node`): the pane
        runs the node's supervisor (`--group-node I`, the group's policy) in front of its
        torchrun argv, with its env added. Otherwise as `start`."""
        return await self._start(node.fresh, "auto", wait_s, progress, node)

    async def _start(
        self,
        fresh: bool,
        resume: str,
        wait_s: float,
        progress: Callable[[str], None] | None,
        node: NodeCommand | None,
    ) -> StartResult:
        st = await self.reader.status_for("start")
        argv = node.argv if node is not None else trainer_argv(self.host.python, fresh, resume)
        if st.state in LIVE_STATES:
            return StartResult(self.host.name, False, st.run_release or "", None, argv)
        if st.measure is not None:  # read in the same round trip as the run's status
            raise measure_refusal(st.measure, self.host.name)
        if st.job is not None:  # an eval or a gate: the same round trip
            raise job_refusal(st.job, self.host.name)
        if st.release is None:
            raise ControlError(
                f"{self.host.name}: nothing deployed; run `dflashctl deploy {self.host.name}`"
            )
        config_text = await self.reader.deployed_config()  # read once: it also gives the rank count
        if st.deployed_config_hash is None and not config_text:
            raise ControlError(
                f"{self.host.name}: no {self.layout.config}; "
                f"deploy with --config PATH or set run_config in hosts.toml"
            )
        if node is None:  # several drafter (or shared target) ranks: torchrun --standalone
            argv = host_trainer_argv(self.host.python, fresh, resume, rank_count(config_text))
        if st.exit_status is not None:  # a dead pane from the last run: clear it
            await self._run(tmux_kill_session(self.host.session))
        release = st.release
        rec = await self._run(
            write_file_atomic(self.layout.running_release, "644"),
            input=f"{release}\n".encode(),
        )
        if not rec.ok:
            raise ControlError(f"{self.host.name}: recording the run's release: {rec.error_line()}")
        env = {
            **self.host.env,
            "PYTHONUNBUFFERED": "1",
            "PYTHONPATH": self.layout.release_dir(release),
            "DFLASH_RELEASE": release,
            **(node.env if node is not None else {}),
        }
        if node is None and argv[1:3] == ["-m", TORCHRUN_MODULE]:
            # torchrun SIGKILLs its ranks 30 s after forwarding a stop's SIGINT by default: a
            # checkpoint of a real-width drafter can take longer (the operator's env wins). A
            # group node's launch env sets it too (groups.launch.GROUP_ENV).
            env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(TORCHRUN_SHUTDOWN_TIMEOUT_S))
        notes = [st.switch_note] if st.switch_note else []
        if node is not None and node.supervisor is not None:
            if not st.release_has_supervisor:
                raise ControlError(
                    f"{self.host.name}: release {release} has no trainer.supervise; a group node "
                    f"runs under it: deploy a current release"
                )
            argv = supervised(self.host.python, node.supervisor, argv)
        elif st.release_has_supervisor and node is None:
            argv = supervised(self.host.python, self.host.supervisor_policy().cli_args(), argv)
        if st.switch_note:
            await self._run(acknowledge_switch(self.host.workdir))
        res = await self.new_session(argv, env)
        if not res.ok:
            raise ControlError(f"{self.host.name}: tmux new-session: {res.error_line()}")
        state = await self.reader.pane_state()
        pid = state.pid if state else None
        if wait_s <= 0:
            return StartResult(self.host.name, True, release, pid, argv, notes=notes)
        if progress:
            progress(f"{self.host.name}: waiting up to {wait_s:g} s for the trainer's setup")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        outcome = await self.wait_started(st.log_lines, wait_s)
        took = loop.time() - t0
        if outcome in {"exited", "restarting"}:
            raise await self.start_failure(st.log_lines, took, restarting=outcome == "restarting")
        return StartResult(
            self.host.name, True, release, pid, argv, outcome == "ready", took, notes
        )

    async def wait_started(self, mark: int, wait_s: float) -> str:
        """Wait (one remote loop) until the trainer started at status.log line `mark` is past
        its setup, is being restarted or has exited: `ready` | `restarting` | `exited` |
        `waiting` (still setting up after `wait_s`)."""
        waited = await self._run(
            start_wait_argv(self.host.workdir, self.host.session, mark, wait_s),
            timeout=wait_s + 60,
        )
        return (waited.stdout.strip().splitlines() or ["waiting"])[-1]

    async def start_failure(self, mark: int, took: float, restarting: bool = False) -> StartFailed:
        """What a trainer that exited during its start said: exit status and last error.

        Under the supervisor the pane's status is the supervisor's, which passes the trainer's
        on (a signal death as 128 + N); a trainer it is restarting is described from its
        restart record, and the message says what the supervisor does next.
        """
        pane = await self._run(tmux_settled_pane_state(self.host.session))
        state = parse_pane_state(pane.stdout) if pane.ok else None
        sig = pane_signal(pane.stdout) if pane.ok else None
        try:
            log = "\n".join(await self.log.log_tail(mark))
        except ControlError:
            log = ""  # the pane still tells
        cap = await self._run(tmux_capture(self.host.session, 300))
        error = last_error_line(log, sanitize_for_terminal(cap.stdout if cap.ok else ""))
        sup_res = await self._run(read_file(self.layout.supervisor_state))
        sup_file, _ = parse_supervisor_file(sup_res.stdout if sup_res.ok else "")
        sup = pane_supervisor(sup_file, state)
        exit_status = state.exit_status if state else None
        after = ""
        if sup and restarting:
            restarts = sup.restarts
            last = restarts[-1] if restarts else {}
            code = last.get("exit_status")
            exit_status, sig = (code, None) if isinstance(code, int) and code >= 0 else (None, None)
            if isinstance(code, int) and code < 0:
                sig = -code
            policy = sup.policy
            wait = last.get("backoff_s")
            after = (
                f"; its supervisor restarts it (restart {len(restarts)} of "
                f"{policy.get('max_restarts', '?')}, in "
                f"{f'{wait:g}' if isinstance(wait, int | float) else '?'} s): "
                f"`dflashctl stop {self.host.name}` ends it"
            )
        elif sup and sig is None and isinstance(exit_status, int) and exit_status > 128:
            sig = exit_status - 128  # the supervisor exits 128 + N for a trainer killed by N
        how = describe_exit(exit_status, sig)
        return StartFailed(
            f"{self.host.name}: the trainer {how} {took:.0f} s after it was started: "
            f"{error or 'it printed nothing'}{after}"
        )

    async def new_session(self, argv: list[str], env: dict[str, str]) -> CommandResult:
        """`tmux new-session` for the host's session running argv in the workdir.

        Killing a server's last session makes it exit, and a client that reaches it meanwhile
        fails with "server exited unexpectedly" (stop, or start clearing a dead pane, right
        before a new session): that is retried, so a restart never fails on the timing.
        """
        command = tmux_new_session(self.host.session, argv, cwd=self.host.workdir, env=env)
        for attempt in range(5):
            res = await self._run(command)
            if res.ok or "server exited unexpectedly" not in res.stderr:
                break
            await asyncio.sleep(0.1 * (attempt + 1))
        return res
