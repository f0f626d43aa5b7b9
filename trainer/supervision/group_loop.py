"""`python -m trainer.supervise --group-node I ... -- python -m torch.distributed.run ...`: one
group node's supervisor, torchrun's parent.

torchrun (the elastic agent, c10d rendezvous on node 0) restarts the whole worker group when any
rank fails, up to its --max-restarts; this loop watches it (`agent.AgentTee`), records each
failure on this node and each group restart, gives up once the group's budget is spent (every
node counts the same restarts: `group.GroupBudget`), ends the group at a worker exit that must
not be restarted (`no_restart_exit_codes`, exit 3), runs the stall watchdog on node 0 (rank 0's
status.log is there), and restarts the agent itself when it dies (killed, or its rendezvous
broke because node 0's went away), after a backoff; a node other than 0 first waits for node
0's rendezvous to accept connections again, within the rendezvous timeout.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import IO, TextIO

from trainer.config.policy import Policy, exit_code, restart_argv
from trainer.errors import ExitCode
from trainer.events import format_phase_line
from trainer.supervision import child as children
from trainer.supervision import procinfo
from trainer.supervision.agent import (
    AgentEvent,
    AgentTee,
    Exhausted,
    RendezvousDone,
    RendezvousFailed,
    Rendezvousing,
    Restarting,
    WorkerFailed,
    error_line,
)
from trainer.supervision.child import TICK_S, Child
from trainer.supervision.console import PREFIX, Console
from trainer.supervision.diskwatch import DiskWatch
from trainer.supervision.flags import DISK_CHECK_S
from trainer.supervision.group import (
    AgentLife,
    GroupBudget,
    GroupNode,
    agent_verdict,
    endpoint_up,
)
from trainer.supervision.group_record import GroupRecord
from trainer.supervision.progress import LogTail, Progress
from trainer.supervision.restarts import GiveUp
from trainer.supervision.stall import kill_stalled_ranks
from trainer.supervision.statefile import StateFile, read_trainer_record

ORPHAN_AGENT_S = 10.0
"""After a stop, how long an agent without workers may linger before it is killed."""
AGENT_STOP_GRACE_S = 60.0
"""How long an agent this supervisor ends (a give-up, a refusal) gets after SIGTERM."""


class GroupSupervisor:
    def __init__(
        self,
        policy: Policy,
        node: GroupNode,
        argv: list[str],
        run_dir: Path,
        out: TextIO = sys.stdout,
        err: IO[bytes] | None = None,
        disk_check_s: float = DISK_CHECK_S,
    ) -> None:
        self.policy, self.node, self.argv, self.run_dir = policy, node, argv, run_dir
        self.err = err if err is not None else sys.stderr.buffer
        self.console = Console(run_dir, out)
        self.disk = DiskWatch(run_dir, argv, self.console)
        self.disk_check_s = disk_check_s
        self.budget = GroupBudget(policy)
        self.record = GroupRecord(node, policy, argv, StateFile(run_dir, self.console))
        self.child: Child | None = None
        self.stop_signal: str | None = None
        self.ending: str | None = None  # why this loop ends the running agent (give-up, ...)

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.stop_signal = self.stop_signal or signal.Signals(signum).name
        children.forward(self.child, signum)  # torchrun passes it on to each rank once

    # ------------------------------------------------------------------ one agent
    def run_agent(self, argv: list[str]) -> AgentLife:
        env = {**os.environ, "LOGLEVEL": os.environ.get("LOGLEVEL", "INFO")}
        child = self.child = children.spawn(argv, pipe_stderr=True, env=env)
        if self.stop_signal is not None:
            os.kill(child.pid, signal.SIGINT)
        assert child.stderr is not None
        tee = AgentTee(child.stderr, self.err)
        life, self.ending = AgentLife(), None
        log = self.run_dir / "status.log"
        tail = LogTail(log, LogTail.size(log)) if self.node.node_rank == 0 else None
        progress = Progress(time.monotonic())
        self.record.agent_started(child.pid)
        stopping_at: float | None = None
        idle_since: float | None = None  # stopped, and the agent has no workers left
        while child.poll() is None:
            time.sleep(TICK_S)
            now = time.monotonic()
            for ev in tee.drain():
                progress = self._on_event(ev, life, progress, now)
            if tail is not None:
                progress.feed_lines(tail.read(), now)
                self.record.progress(progress.checkpoint_step)
            if now - self.disk.checked >= self.disk_check_s:
                self._check_disk()
            if self.stop_signal is not None:
                # torchrun stuck waiting for its peers at its exit (a C++ wait: the signal we
                # passed on waits for it) holds its node's rendezvous port: end it once its
                # workers are gone
                idle_since = idle_since or (now if not procinfo.children(child.pid) else None)
                if idle_since is not None and now - idle_since > ORPHAN_AGENT_S:
                    child.kill()
                continue
            if self.ending is not None and stopping_at is None:
                self.console.say(f"{PREFIX}{self.ending}: ending the agent (pid {child.pid})")
                os.kill(child.pid, signal.SIGTERM)
                stopping_at = now
            elif stopping_at is not None and now - stopping_at > AGENT_STOP_GRACE_S:
                child.kill()
            elif self.record.state["state"] == "running" and tail is not None:
                self._watch_stall(child, progress, now)
        orphans = children.end_orphans()  # an agent killed outright leaves its workers to us
        if orphans:
            self.console.say(f"{PREFIX}ended the dead agent's workers: {orphans}")
        tee.join(5.0)  # they held its stderr too
        for ev in tee.drain():
            self._on_event(ev, life, progress, time.monotonic())
        life.returncode = child.returncode
        life.error = error_line(list(tee.tail))
        life.operator_stop = self.stop_signal is not None
        life.trainer_state, life.trainer_exit = read_trainer_record(self.run_dir, child.pid)
        life.errors = list(progress.errors)
        return life

    def _on_event(
        self, ev: AgentEvent, life: AgentLife, progress: Progress, now: float
    ) -> Progress:
        if isinstance(ev, Rendezvousing):
            self.record.rendezvous()
        elif isinstance(ev, RendezvousDone):
            self.budget.new_round()
            self.record.round_done(ev.group_rank)
            return Progress(now)  # the watchdog times the new attempt from its start
        elif isinstance(ev, WorkerFailed):
            why = self.record.worker_failed(ev, self.policy)
            if why is not None and self.ending is None:
                life.no_restart = self.ending = why
        elif isinstance(ev, Restarting):
            if self.ending is not None:
                return progress  # torchrun restarts before we end it: no restart of ours
            plan = self.budget.restart(now, self.record.restart_reason(ev.why))
            if isinstance(plan, GiveUp):
                self.ending = self.ending or f"gave up {plan.detail}"
            elif plan is not None:
                self.record.restarting("workers", plan.number, 0.0, self.console)
        elif isinstance(ev, RendezvousFailed):
            life.rendezvous = ev.kind
        elif isinstance(ev, Exhausted):
            life.exhausted = True
        return progress

    def _watch_stall(self, child: Child, progress: Progress, now: float) -> None:
        limit = progress.idle_limit(self.policy.stall_timeout_s, self.policy.startup_timeout_s)
        idle = now - progress.last_progress
        if idle <= limit:
            return
        ranks = procinfo.children(child.pid)
        if not ranks:  # its workers ended (the agent waits for the others at its exit)
            progress.last_progress = now
            return
        self.record.stalled(ranks, idle, limit)
        kill_stalled_ranks(ranks, idle, limit, self.policy.kill_grace_s, self.console)
        progress.last_progress = now  # torchrun now restarts the group (or gives up)

    def _check_disk(self) -> None:
        was = self.disk.low_disks
        self.disk.check()
        if self.disk.low_disks != was:
            self.record.save(low_disk=self.disk.low_disk, low_disks=self.disk.low_disks)

    # ------------------------------------------------------------------ the loop
    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, self._on_signal)
        children.become_subreaper()
        self._check_disk()
        argv = list(self.argv)
        while True:
            try:
                life = self.run_agent(argv)
            except OSError as exc:
                return self.record.end("failed", f"cannot start torchrun: {exc}", ExitCode.USAGE)
            status = exit_code(life.returncode if life.returncode is not None else 1)
            if self.ending is not None and self.ending.startswith("gave up"):
                self.console.say(format_phase_line("gave_up", self.ending[8:]), status_log=True)
                return self.record.end("gave-up", self.ending, status or ExitCode.FAILED)
            verdict, why = agent_verdict(life, self.policy, self.node)
            if verdict in ("finished", "stopped"):
                self.console.say(f"{PREFIX}{why}: not restarting")
                ok = life.trainer_state == "stopped" and life.trainer_exit == 0
                return self.record.end(verdict, why, 0 if ok or verdict == "finished" else status)
            if verdict == "not-restarted":
                self.console.say(format_phase_line("not_restarting", why), status_log=True)
                return self.record.end(verdict, why, status or ExitCode.FAILED)
            self.record.agent_failed(life, why)
            plan = self.budget.restart(time.monotonic(), why, agent=True)
            assert plan is not None  # an agent restart always counts
            if isinstance(plan, GiveUp):
                self.console.say(format_phase_line("gave_up", plan.detail), status_log=True)
                return self.record.end("gave-up", f"gave up {plan.detail}", status or 1)
            self.record.restarting("agent", plan.number, plan.wait, self.console)
            if not self._backoff(plan.wait):
                why = f"stopped by the operator ({self.stop_signal}) during the restart backoff"
                self.console.say(f"{PREFIX}{why}: not restarting")
                return self.record.end("stopped", why, status)
            if self.node.node_rank != 0 and not self._node0_back(life):
                why = (
                    f"node 0's rendezvous at {self.node.host}:{self.node.port} did not come back "
                    f"within {self.node.rendezvous_timeout_s:g} s"
                )
                self.console.say(format_phase_line("gave_up", why), status_log=True)
                return self.record.end("gave-up", f"gave up: {why}", status or ExitCode.FAILED)
            argv = restart_argv(self.argv, self.record.wrote_checkpoint)

    def _backoff(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and self.stop_signal is None:
            time.sleep(min(TICK_S, max(0.0, deadline - time.monotonic())))
        return self.stop_signal is None

    def _node0_back(self, life: AgentLife) -> bool:
        """Wait until node 0's rendezvous accepts connections again. When this node's agent
        ended the round (it closed the rendezvous, or spent torchrun's restarts), node 0's
        agent goes down with it first: wait for that too, so the new agent never meets the
        old, closed rendezvous."""
        n = self.node
        deadline = time.monotonic() + n.rendezvous_timeout_s
        down_first = life.rendezvous == "closed" or life.exhausted
        self.record.save(detail=f"waiting for node 0's rendezvous at {n.host}:{n.port}")
        while self.stop_signal is None and time.monotonic() < deadline:
            up = endpoint_up(n.host, n.port)
            if down_first and not up:
                down_first = False
            elif up and not down_first:
                return True
            time.sleep(0.5)
        return False
