"""Run control: start, stop, restart, status, follow, GPUs — over any Transport.

The trainer runs in tmux on a private socket (`-L dflash`), session name from the inventory,
exact-match targets, remain-on-exit (a crash leaves a dead pane with its exit status). It is
started against a resolved release directory, not the `current` symlink, so a deploy while it
runs never swaps code under it; `run/.release` records which release that is (deploy never
prunes it).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from dflashctl.config.inventory import NAME_RE, HostConfig, InventoryError
from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.gpus.health import (
    LEGACY_REASONS_PREFIX,
    REASONS_PREFIX,
    GpuHealth,
    health_fields,
    health_query_argv,
    parse_health_csv,
    unknown_query_field,
)
from dflashctl.groups.launch import NodeLaunch
from dflashctl.releases.deploy import (
    DeployResult,
    deploy,
    push_config_file,
)
from dflashctl.releases.release import Release
from dflashctl.remote.commands import SUPERVISOR_MODULE, guarded, supervised
from dflashctl.remote.files import line_count, read_file, tail_follow, tail_from, write_file_atomic
from dflashctl.remote.layout import (
    CONFIG,
    STATUS_LOG,
    RemoteLayout,
)
from dflashctl.remote.layout import SUPERVISOR_SOURCE as SUPERVISOR_FILE
from dflashctl.remote.release import acknowledge_switch
from dflashctl.remote.run import MARK as MARK
from dflashctl.remote.run import STATUS_SCRIPT as STATUS_SCRIPT
from dflashctl.remote.run import (
    TORCHRUN_MODULE,
    gpu_query_argv,
    host_trainer_argv,
    start_wait_argv,
    status_argv,
)
from dflashctl.remote.run import stop_wait_argv as stop_wait_argv
from dflashctl.remote.run import trainer_argv as trainer_argv
from dflashctl.remote.tmux import (
    PaneState,
    parse_pane_state,
    tmux_capture,
    tmux_interrupt,
    tmux_kill_session,
    tmux_new_session,
    tmux_settled_pane_state,
)
from dflashctl.remote.transport import (
    CommandResult,
    CommandTimeout,
    HostUnreachable,
    Transport,
    TransportError,
)
from dflashctl.runs.follow import Backoff, FollowEvent, LogFollower
from dflashctl.runs.snapshot import (
    GpuSample,
    RunningMeasure,
    RunStatus,
    describe_exit,
    last_error_line,
    pane_signal,
    pane_supervisor,
    parse_events,
    parse_gpu_csv,
    parse_status,
    parse_supervisor_file,
)
from trainer.events import (
    CheckpointEvent,
    sanitize_for_terminal,
)

if TYPE_CHECKING:
    from dflashctl.releases.resume import CheckpointConfig

FOLLOW_JITTER = 0.2
"""`follow`'s reconnect delays vary by +-20 %, so many clients of one host do not reconnect in
step."""
DEFAULT_START_WAIT_S = 120.0
"""How long start/restart wait for the trainer's setup (or its exit); hosts.toml start_wait."""
LIVE_STATES = frozenset({"running", "restarting", "stalled"})
"""States whose pane process (the supervisor, or an unsupervised trainer) is alive: stop acts,
start is a no-op. restarting: the trainer died and the supervisor waits out its backoff;
stalled: the watchdog is stopping a trainer that made no progress."""


class ControlError(DflashctlError):
    """A run-control operation failed (one line naming the host)."""

    exit_code = ExitCode.FAILED


class StartFailed(ControlError):
    """The trainer exited right after it was started (exit status and its last error line)."""


class MeasureInProgress(ControlError):
    """A start refused while `dflashctl measure` runs on the host (both would use its devices)."""


@dataclass(frozen=True)
class StartResult:
    host: str
    started: bool  # False: it was already running
    release: str
    pane_pid: int | None
    argv: list[str]
    ready: bool | None = None  # past setup (a phase line); False: still starting after wait_s
    waited_s: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def supervised(self) -> bool:
        """Under the in-container supervisor (the release ships it; older ones run bare)."""
        return SUPERVISOR_MODULE in self.argv

    def supervisor_note(self) -> str | None:
        """What an unsupervised start means, for people; None when supervised."""
        if self.supervised or not self.started:
            return None
        return (
            f"release {self.release} has no {SUPERVISOR_FILE}: the trainer runs without its "
            f"supervisor (no restart on failure, no stall watchdog); deploy a newer tree"
        )


@dataclass(frozen=True)
class StopResult:
    host: str
    was_running: bool
    checkpoint: CheckpointEvent | None
    outcome: str  # exited | checkpointed | timeout | not-running | dead
    exit_status: int | None = None

    def summary(self) -> str:
        """What stop found and did, for people (the CLI and the demo print it)."""
        if not self.was_running:
            if self.exit_status is None:
                return "not running"
            return f"not running: the run had already exited with status {self.exit_status}"
        ck = self.checkpoint
        saved = f"checkpoint step {ck.step} at {ck.path}" if ck else "NO checkpoint line seen"
        return f"stopped ({self.outcome}); {saved}"


@dataclass(frozen=True)
class RestartResult:
    host: str
    deploy: DeployResult
    stop: StopResult
    start: StartResult
    config_diff: str
    old_config_hash: str | None
    new_config_hash: str | None


class RunService(Protocol):
    """What the monitor, the TUI, the CLI and their test doubles use of one host's run.

    `RunControl` is the implementation over a Transport; doubles (tests, replays) implement the
    same signatures. `tail_log` is one connection's stream (it ends, or raises TransportError,
    when that link drops); the reconnecting loop around it lives in `dflashctl.runs.follow`.
    """

    async def status(self, *, setup_errors: bool = False) -> RunStatus: ...

    async def deployed_config(self) -> str: ...

    async def checkpoint_config(self, resume: str = "auto") -> CheckpointConfig | None: ...

    async def gpus(self) -> list[GpuSample]: ...

    async def start(
        self,
        *,
        fresh: bool = False,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Callable[[str], None] | None = None,
    ) -> StartResult: ...

    async def stop(self, timeout: float = 120.0) -> StopResult: ...

    async def restart(
        self,
        fresh: bool = False,
        *,
        config: Path | None = None,
        stop_timeout: float = 120.0,
        progress: Callable[[str], None] | None = None,
        release: Release | None = None,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
    ) -> RestartResult: ...

    def tail_log(self, from_line: int) -> AsyncIterator[str]: ...

    async def log_line_count(self) -> int | None: ...

    def follow(
        self,
        from_line: int = 0,
        *,
        delay: Callable[[int], float] | None = None,
        max_attempts: int | None = None,
    ) -> AsyncGenerator[FollowEvent, None]: ...


# --- pure builders and parsers -------------------------------------------------------------


def measure_refusal(
    m: RunningMeasure, name: str, what: str = "a training run"
) -> MeasureInProgress:
    """Why `what` does not start on host `name` while measure `m` runs there (one line: the
    host, the measure's id and since when, how to see and stop it)."""
    return MeasureInProgress(
        f"{name}: measure {m.id} is running there (since {m.since}, tmux session "
        f"{m.session!r}): {what} would share its devices; `dflashctl measure {name} --result` "
        f"shows how far it is, `dflashctl measure {name} --stop` ends it"
    )


TORCHRUN_SHUTDOWN_TIMEOUT_S = 600
"""How long torchrun waits for its ranks after forwarding a stop before it SIGKILLs them."""


def _rank_count(config_text: str) -> int:
    """The ranks the deployed config needs on this host; 1 when it does not validate here (the
    trainer names the problem itself, as it did before torchrun starts existed)."""
    from dflashctl.config.runconfig import RunConfigError, drafter_device_count

    try:
        return drafter_device_count(config_text) if config_text else 1
    except RunConfigError:
        return 1


def interrupt_children(pid: int) -> list[str]:
    """SIGINT to every child of `pid` (a group node's torchrun: its trainer ranks)."""
    return ["pkill", "-INT", "-P", str(int(pid))]


def kill_if_childless(pid: int) -> list[str]:
    """SIGKILL `pid` unless it still has children (a torchrun whose ranks all exited)."""
    # without pgrep nothing is known of its children: then nothing is killed
    script = 'command -v pgrep >/dev/null && ! pgrep -P "$1" >/dev/null && kill -KILL "$1"'
    return ["sh", "-c", script, "kill-if-childless", str(int(pid))]


# --- the service ---------------------------------------------------------------------------


class RunControl:
    """Operate one host's run through a Transport (SSH+pct or local)."""

    def __init__(self, transport: Transport, host: HostConfig) -> None:
        self.transport = transport
        self.host = host
        self.layout = RemoteLayout(host.workdir)
        self._health_prefix = REASONS_PREFIX  # nvidia-smi's clock-event field names (535+)

    async def _run(
        self, argv: list[str], *, timeout: float | None = None, input: bytes | None = None
    ) -> CommandResult:
        # timeout None: the transport's own default, the host's command_timeout.
        return await self.transport.run(argv, timeout=timeout, input=input)

    async def _pane_state(self) -> PaneState | None:
        """The pane's state once tmux has its exit status (one round trip); None: no session."""
        res = await self._run(tmux_settled_pane_state(self.host.session))
        return parse_pane_state(res.stdout) if res.ok else None

    async def status(self, *, setup_errors: bool = False) -> RunStatus:
        """Never raises for transport problems: an unreachable host is a state.

        A local SSH setup problem (missing identity file, unreadable known_hosts: an
        InventoryError) is that host's state too, except with `setup_errors`, which the
        single-host commands pass so it reaches the user as the config error it is (exit 2).
        """
        from dflashctl.config.runconfig import config_hash_of_text

        try:
            res = await self._run(status_argv(self.host.workdir, self.host.session))
        except TransportError as err:
            if setup_errors and isinstance(err, InventoryError):
                raise
            return RunStatus(host=self.host.name, state="unreachable", message=str(err))
        if not res.ok:
            msg = res.error_line()
            if "not running" in msg:
                msg = f"container {self.host.ctid} is not running (pct start {self.host.ctid})"
            return RunStatus(
                host=self.host.name,
                state="unreachable",
                message=sanitize_for_terminal(f"{self.host.name}: {msg}"),
            )
        return parse_status(
            self.host.name, res.stdout, config_hash_of_text, session=self.host.session
        )

    async def deployed_config(self) -> str:
        res = await self._run(read_file(self.layout.config))
        return res.stdout if res.ok else ""

    async def push_config(self, path: Path) -> None:
        await push_config_file(self.transport, self.host, path)

    async def put_secret(self, name: str, data: bytes) -> str:
        """Write a secret to WORKDIR/secrets/NAME (0600) through stdin: never on a command line."""
        if not NAME_RE.match(name):
            raise ControlError(f"{self.host.name}: secret name {name!r} is not a plain name")
        path = self.layout.secret(name)
        res = await self._run(write_file_atomic(path, "600"), input=data)
        if not res.ok:
            raise ControlError(f"{self.host.name}: writing {path}: {res.error_line()}")
        return path

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
        launch: NodeLaunch,
        *,
        wait_s: float = DEFAULT_START_WAIT_S,
        progress: Callable[[str], None] | None = None,
    ) -> StartResult:
        """Start this host's part of a group (`dflashctl.groups.launch`): the pane runs the launch's
        torchrun argv with its env added, and no supervisor: a node restarted alone cannot
        rejoin the group's static rendezvous, so a group's restarts are the whole group's
        (`dflashctl restart GROUP`). Otherwise as `start`."""
        fresh = "--fresh" in launch.program
        return await self._start(fresh, "auto", wait_s, progress, launch)

    async def _start(
        self,
        fresh: bool,
        resume: str,
        wait_s: float,
        progress: Callable[[str], None] | None,
        launch: NodeLaunch | None,
    ) -> StartResult:
        st = await self.status(setup_errors=True)
        if st.state == "unreachable":
            raise HostUnreachable(st.message or f"{self.host.name}: unreachable")
        argv = launch.argv if launch is not None else trainer_argv(self.host.python, fresh, resume)
        if st.state in LIVE_STATES:
            return StartResult(self.host.name, False, st.run_release or "", None, argv)
        if st.measure is not None:  # read in the same round trip as the run's status
            raise measure_refusal(st.measure, self.host.name)
        if st.release is None:
            raise ControlError(
                f"{self.host.name}: nothing deployed; run `dflashctl deploy {self.host.name}`"
            )
        config_text = await self.deployed_config()  # read once: it also gives the rank count
        if st.deployed_config_hash is None and not config_text:
            raise ControlError(
                f"{self.host.name}: no {self.layout.config}; "
                f"deploy with --config PATH or set run_config in hosts.toml"
            )
        if launch is None:  # several drafter (or shared target) ranks: torchrun --standalone
            argv = host_trainer_argv(self.host.python, fresh, resume, _rank_count(config_text))
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
            **(launch.env if launch is not None else {}),
        }
        if launch is None and argv[1:3] == ["-m", TORCHRUN_MODULE]:
            # torchrun SIGKILLs its ranks 30 s after forwarding a stop's SIGINT by default: a
            # checkpoint of a real-width drafter can take longer (the operator's env wins). Not
            # for group nodes: there a dead peer must end the others' ranks promptly.
            env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(TORCHRUN_SHUTDOWN_TIMEOUT_S))
        notes = [st.switch_note] if st.switch_note else []
        if st.release_has_supervisor and launch is None:
            argv = supervised(self.host.python, self.host.supervisor_policy().cli_args(), argv)
        if st.switch_note:
            await self._run(acknowledge_switch(self.host.workdir))
        res = await self.new_session(argv, env)
        if not res.ok:
            raise ControlError(f"{self.host.name}: tmux new-session: {res.error_line()}")
        state = await self._pane_state()
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
            log = "\n".join(await self.log_tail(mark))
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
    ) -> StopResult:
        """Stop this host's part of a group, as `stop` does, except:

        SIGINT goes to the pane process's children, the trainer ranks, not to torchrun:
        torchrun would pass a second SIGINT on (a stop at once, no checkpoint) and exit as a
        signal death; the ranks' stop is agreed in the step's reduce, so they stop at the same
        step and torchrun exits 0.
        `settle_s`: after the checkpoint line, wait up to this long more for the pane's
        process to exit by itself (torchrun meets its peers at an exit barrier: ending its
        session before would fail the other nodes' agents and leave this one holding its
        rendezvous port while it shuts down). `interrupt=False`: the ranks were signalled
        already (a group's other nodes): only wait and clear. `after_interrupt` runs right
        after this node's SIGINT, before the wait (a group signals its other nodes there).
        """
        return await self._stop(
            timeout,
            workers=True,
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
        st = await self.status(setup_errors=True)
        if st.state == "unreachable":
            raise HostUnreachable(st.message or f"{self.host.name}: unreachable")
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
        elif not workers:
            sent = await self._run(tmux_interrupt(self.host.session))
            if not sent.ok:
                raise ControlError(f"{self.host.name}: sending C-c: {sent.error_line()}")
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
        state = await self._pane_state()
        if workers and state is not None and not state.dead and state.pid is not None:
            # torchrun outlived its ranks (stuck at its exit barrier: a peer's agent failed);
            # ending the session alone would not end it (it handles SIGHUP only between
            # waits) and it would hold the rendezvous port: killed, once it has no ranks left
            await self._run(kill_if_childless(state.pid))
        await self._run(tmux_kill_session(self.host.session))
        best = max(ckpts, key=lambda e: e.step) if ckpts else None
        return StopResult(
            self.host.name, True, best, outcome, state.exit_status if state and state.dead else None
        )

    async def interrupt_workers(self) -> None:
        """SIGINT to the pane process's children (a group node's torchrun: its ranks)."""
        pane = await self._pane_state()
        if pane is None or pane.pid is None or pane.dead:
            return
        sent = await self._run(interrupt_children(pane.pid))
        # pkill's 1: no child (the ranks exited meanwhile): the stop's wait sees the exit
        if sent.rc not in {0, 1}:
            raise ControlError(f"{self.host.name}: SIGINT to the ranks: {sent.error_line()}")

    async def restart(
        self,
        fresh: bool = False,
        *,
        config: Path | None = None,
        stop_timeout: float = 120.0,
        progress: Callable[[str], None] | None = None,
        release: Release | None = None,
        resume: str = "auto",
        wait_s: float = DEFAULT_START_WAIT_S,
    ) -> RestartResult:
        """Push config, deploy if the tree changed, stop, start.

        Refused (MeasureInProgress) before anything is pushed while a measure runs there.

        Refuses (ResumeRefused) when the config cannot resume the checkpoint a resume would load
        and `fresh` is not set: silently training from scratch, or crashing on resume, both waste
        GPU hours. The check is the one `deploy --config` makes (dflashctl.releases.resume).
        """
        from dflashctl.config.runconfig import (
            config_diff,
            config_hash_of_file,
            config_hash_of_text,
            read_config_text,
            validate_config,
        )
        from dflashctl.releases.resume import check_config_push

        path = config or self.host.run_config
        if path is not None:  # a bad local config fails before anything touches the host
            new_text = read_config_text(path)
            validate_config(path)
        before = await self.status(setup_errors=True)
        if before.measure is not None:  # refused before the deploy and the stop, not after
            raise measure_refusal(before.measure, self.host.name, "a restarted run")
        old_text = await self.deployed_config()
        diff = ""
        new_hash = config_hash_of_text(old_text) if old_text else None
        if path is not None:
            diff = config_diff(
                old_text, new_text, old_name=f"{self.host.name}:{CONFIG}", new_name=str(path)
            )
            check = await check_config_push(
                self.transport, self.host, path, fresh=fresh, resume=resume
            )
            for note in check.notes:
                if progress:
                    progress(note)
            new_hash = config_hash_of_file(path)
        dep = await deploy(
            self.transport,
            self.host,
            config=path,
            progress=progress,
            release=release,
            resume_checked=True,
            memory_check=True,  # refuse a config that cannot fit before the run is stopped
        )
        stopped = await self.stop(stop_timeout)
        started = await self.start(fresh=fresh, resume=resume, wait_s=wait_s, progress=progress)
        return RestartResult(
            self.host.name,
            dep,
            stopped,
            started,
            diff,
            config_hash_of_text(old_text) if old_text else None,
            new_hash,
        )

    async def checkpoint_config(self, resume: str = "auto") -> CheckpointConfig | None:
        """The config saved in the checkpoint a resume would load (None: cannot tell)."""
        from dflashctl.releases.resume import read_checkpoint_config

        return await read_checkpoint_config(self.transport, self.host, resume)

    async def gpus(self) -> list[GpuSample]:
        """GPU samples from nvidia-smi in the container ([] when it has none)."""
        res = await self._run(gpu_query_argv())
        if res.rc == 127 or "not found" in res.stderr or "No such file" in res.stderr:
            return []
        if not res.ok:
            raise ControlError(f"{self.host.name}: nvidia-smi: {res.error_line()}")
        return parse_gpu_csv(res.stdout)

    async def gpu_health(self) -> list[GpuHealth]:
        """ECC counts and clock-event (throttle) reasons per GPU ([] without nvidia-smi). A
        pre-535 driver refuses the new field names: asked again with its own, remembered."""
        for _ in range(2):
            prefix = self._health_prefix
            res = await self._run(health_query_argv(prefix))
            if res.rc == 127 or "not found" in res.stderr or "No such file" in res.stderr:
                return []
            if unknown_query_field(res.stderr) and prefix == REASONS_PREFIX:
                self._health_prefix = LEGACY_REASONS_PREFIX
                continue
            if not res.ok:
                raise ControlError(f"{self.host.name}: nvidia-smi: {res.error_line()}")
            healths, errors = parse_health_csv(res.stdout, health_fields(prefix))
            if errors and not healths:
                raise ControlError(f"{self.host.name}: {errors[0]}")
            return healths
        return []

    async def log_tail(self, from_line: int) -> list[str]:
        """run/status.log from 0-based `from_line`, made safe to print."""
        res = await self._run(tail_from(self.layout.status_log, from_line))
        if not res.ok and "No such file" not in res.stderr:
            raise ControlError(f"{self.host.name}: reading {STATUS_LOG}: {res.error_line()}")
        return sanitize_for_terminal(res.stdout).splitlines()

    async def log_line_count(self) -> int | None:
        """Lines in run/status.log now: 0 when it is gone, None when it cannot be told (a
        command timeout, an unreadable answer). A follower compares it with the lines it has
        read to see that the log started over."""
        try:
            res = await self._run(line_count(self.layout.status_log))
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


if TYPE_CHECKING:
    _: type[RunService] = RunControl  # RunControl satisfies the protocol (checked by mypy)
