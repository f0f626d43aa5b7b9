"""`python -m trainer.supervise [OPTIONS] -- python -m trainer --config C --run-dir RUN ...`

Runs the trainer as a child and keeps it running: a failed attempt (a non-zero exit, a signal
death, a stall) is restarted from the newest checkpoint (`--resume auto`, never `--fresh`) after
a backoff that doubles per restart, at most `--max-restarts` times within `--restart-window-s`;
then it gives up, once. Never restarted: a finished run, a stop (the supervisor or the trainer
was signalled), an exit status in `--no-restart-exit-codes`, the trainer's non-finite divergence
stop, its stop for checkpoints that keep failing (exit 3, whatever the flag says). Stall
watchdog: no new step, checkpoint or phase line in RUN/status.log for `--stall-timeout-s`
(`--startup-timeout-s` before the first step) -> /proc snapshot and the trainer's thread stacks
(SIGUSR1, faulthandler) into RUN/console.log, SIGINT, SIGKILL after `--kill-grace-s`, then the
policy.

Disk: free space on every filesystem the trainer writes to (RUN, RUN/checkpoints, the exports,
the trackers' dirs; each filesystem once, named by the trainer's directory on it). Where the
checkpoints go, against the newest checkpoint's size times the checkpoints retention keeps (the
trainer argv's `--config`: checkpoint.keep_last + the best when it evaluates + the one being
written, less those already there; one checkpoint without a readable config); elsewhere against
the exports or the logs (`trainer.supervision.filesystems`). At start, every `--disk-check-s`
while the trainer runs (a `low_disk` phase line per filesystem and change, `low_disk` and
`low_disks` in the state; the trainer is not stopped for it), and before every restart (less than
one checkpoint where the checkpoints go: not restarted, since the restart would fail its first
checkpoint the same way).

`--child regen` runs a regeneration job instead (`python -m trainer.regen ... --run-dir RUN`): a
restart adds `--resume` (the rows already written are skipped), and its `Regen:` status lines are
its progress for the stall watchdog.

Signals: the trainer runs in its own session, so a Ctrl-C in the tmux pane reaches it exactly
once, forwarded by the supervisor (SIGINT, SIGTERM, SIGHUP). A signal during a backoff ends the
supervisor without another attempt. State: RUN/supervisor.json (this process is its only
writer; while it cannot be written, a `state_stale` line on stdout says what it is instead);
events: phase lines on stdout, RUN/status.log and RUN/console.log.

Group nodes (`--group-node I`, dflashctl's `start GROUP`): the argv is the node's torchrun with
the c10d rendezvous; torchrun restarts the whole worker group when a rank fails, and this
supervisor counts those restarts for the group, ends the group on an exit that must not be
restarted, and restarts a dead agent (`trainer.supervision.group_loop`).

Exit status: the last attempt's (a signal death is 128 + N), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from trainer.config.policy import (
    Ending,
    Policy,
    decide,
    exit_code,
    regen_restart_argv,
    restart_argv,
    run_dir_of,
)
from trainer.errors import ExitCode
from trainer.events import format_error_line, format_phase_line
from trainer.supervision import child as children
from trainer.supervision import procinfo
from trainer.supervision.child import TICK_S, Child
from trainer.supervision.console import PREFIX, Console
from trainer.supervision.diskwatch import DiskWatch
from trainer.supervision.filesystems import Space
from trainer.supervision.flags import DISK_CHECK_S, parse_policy, split_argv
from trainer.supervision.flags import parser as flags_parser
from trainer.supervision.progress import LogTail, Progress
from trainer.supervision.restarts import GiveUp, NextRestart, RestartHistory
from trainer.supervision.stall import stop_stalled
from trainer.supervision.statefile import StateFile, initial_state, read_trainer_record

__all__ = ["DISK_CHECK_S", "TICK_S", "Supervisor", "main", "parse_policy"]

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def _parser() -> argparse.ArgumentParser:
    return flags_parser(__doc__.splitlines()[0])


class Supervisor:
    """The supervise loop: run an attempt, ask the policy, restart after a backoff or end."""

    def __init__(
        self,
        policy: Policy,
        argv: list[str],
        run_dir: Path,
        out: TextIO = sys.stdout,
        disk_check_s: float = DISK_CHECK_S,
        child: str = "trainer",
    ) -> None:
        self.policy, self.argv, self.run_dir, self.out = policy, argv, run_dir, out
        self.child_kind = child
        self.console = Console(run_dir, out)
        self.disk_check_s = disk_check_s
        self.disk = DiskWatch(run_dir, argv, self.console)
        self.history = RestartHistory(policy)
        self.child: Child | None = None
        self.stop_signal: str | None = None
        self.signals = 0
        self.attempt = 0
        self.wrote_checkpoint = False
        self.state: dict[str, Any] = initial_state(policy, argv, self.history.records)
        self.state_file = StateFile(run_dir, self.console)

    # ------------------------------------------------------------------ output
    def say(self, text: str, status_log: bool = False) -> None:
        self.console.say(text, status_log)

    def save(self, **fields: Any) -> None:
        self.state.update(fields)
        self.state_file.write(self.state)

    def end(
        self, line: str, state: str, detail: str, status: int, status_log: bool = False, **more: Any
    ) -> int:
        """Say the supervisor's last line, record its final state, and return its exit status."""
        self.say(line, status_log)
        self.save(state=state, detail=detail, exit_status=status, **more)
        return status

    def check_disk(self) -> Space | None:
        """Free space on every filesystem the trainer writes to; the state's low_disk entries
        follow each change. The checkpoints' filesystem."""
        was = self.disk.low_disks
        space = self.disk.check()
        if self.disk.low_disks != was:
            self.save(low_disk=self.disk.low_disk, low_disks=self.disk.low_disks)
        return space

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals += 1
        self.stop_signal = self.stop_signal or signal.Signals(signum).name
        children.forward(self.child, signum)

    def install_signals(self) -> None:
        for s in FORWARDED:
            signal.signal(s, self._on_signal)

    # ------------------------------------------------------------------ one attempt
    def run_attempt(self, argv: list[str]) -> tuple[Ending, Progress]:
        log = self.run_dir / "status.log"
        tail = LogTail(log, LogTail.size(log))
        oom_before = procinfo.oom_kills()
        self.attempt += 1
        child = self.child = children.spawn(argv)
        if self.stop_signal is not None:  # it came while the child was being created
            os.kill(child.pid, signal.SIGINT)
        progress = Progress(time.monotonic())
        self.save(state="running", attempt=self.attempt, trainer_pid=child.pid, detail=None)
        stalled: float | None = None
        while child.poll() is None:
            time.sleep(TICK_S)
            now = time.monotonic()
            self._feed(tail, progress, now)
            if now - self.disk.checked >= self.disk_check_s:
                self.check_disk()
            if self.stop_signal is not None:
                continue  # a stop is the trainer's to finish; the watchdog stands down
            limit = progress.idle_limit(self.policy.stall_timeout_s, self.policy.startup_timeout_s)
            idle = now - progress.last_progress
            if idle > limit and child.poll() is None:
                stalled = limit
                self.save(
                    state="stalled", detail=f"no progress for {idle:.0f} s (limit {limit:g} s)"
                )
                stop_stalled(child, idle, limit, self.policy.kill_grace_s, self.console)
        self._feed(tail, progress, time.monotonic())
        oom_after = procinfo.oom_kills()
        trainer_state, trainer_exit = read_trainer_record(self.run_dir, child.pid)
        ending = Ending(
            returncode=child.returncode,
            operator_stop=self.stop_signal is not None,
            stalled_s=stalled,
            trainer_state=trainer_state,
            trainer_exit=trainer_exit if trainer_exit != child.returncode else None,
            errors=tuple(progress.errors),
            oom_killed=child.returncode == -signal.SIGKILL
            and oom_before is not None
            and oom_after is not None
            and oom_after > oom_before,
        )
        return ending, progress

    def _feed(self, tail: LogTail, progress: Progress, now: float) -> None:
        before = progress.resumed_step
        progress.feed_lines(tail.read(), now)
        if progress.checkpoint_step is not None:
            self.wrote_checkpoint = True
        resumed = progress.resumed_step
        if before is None and resumed is not None and self.history.resumed(resumed):
            self.save()

    # ------------------------------------------------------------------ the loop
    def _backoff(self, seconds: float) -> bool:
        """Sleep the backoff; False when a stop signal arrived meanwhile."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.stop_signal is not None:
                return False
            time.sleep(min(TICK_S, max(0.0, deadline - time.monotonic())))
        return self.stop_signal is None

    def run(self) -> int:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.install_signals()
        self.check_disk()
        argv = list(self.argv)
        last_checkpoint: int | None = None
        while self.stop_signal is None:
            try:
                ending, progress = self.run_attempt(argv)
            except OSError as exc:
                self.say(
                    format_error_line(
                        f"cannot start the trainer {argv[0]!r}: {exc.strerror or exc}"
                    )
                )
                self.save(state="failed", detail=f"cannot start: {exc}", exit_status=ExitCode.USAGE)
                return ExitCode.USAGE
            if progress.checkpoint_step is not None:
                last_checkpoint = progress.checkpoint_step
            verdict, why = decide(ending, self.policy)
            status = exit_code(ending.returncode)
            if verdict == "finished":
                return self.end(f"{PREFIX}{why}", "finished", why, status)
            if verdict == "stopped":
                by = f" ({self.stop_signal})" if ending.operator_stop else ""
                return self.end(f"{PREFIX}{why}{by}: not restarting", "stopped", why, status)
            if verdict == "not-restarted":
                line = format_phase_line("not_restarting", why)
                return self.end(line, "not-restarted", why, status, status_log=True)
            failed = status or ExitCode.FAILED
            space = self.check_disk()
            if space is not None and space.checkpoints is not None and space.full:
                detail = disk_full_detail(space, why)
                line = format_phase_line("not_restarting", detail)
                return self.end(line, "not-restarted", detail, failed, status_log=True)
            now = time.monotonic()
            plan = self.history.plan(now, why)
            if isinstance(plan, GiveUp):
                line, detail = format_phase_line("gave_up", plan.detail), f"gave up {plan.detail}"
                return self.end(line, "gave-up", detail, failed, status_log=True, gave_up=True)
            number, wait = plan.number, plan.wait
            if self.child_kind == "regen":
                argv = regen_restart_argv(self.argv)
            else:
                argv = restart_argv(self.argv, self.wrote_checkpoint)
            self.history.add(
                now,
                attempt=self.attempt + 1,
                why=why,
                returncode=ending.returncode,
                checkpoint_step=last_checkpoint,
                wait=wait,
            )
            detail = restart_detail(why, ending.returncode, plan, self.policy, last_checkpoint)
            self.say(format_phase_line("restarting", detail), status_log=True)
            self.save(state="restarting", detail=f"{why}: restart {number} in {wait:g} s")
            if not self._backoff(wait):
                why = f"stopped by the operator ({self.stop_signal}) during the restart backoff"
                return self.end(f"{PREFIX}{why}: not restarting", "stopped", why, status)
        self.save(state="stopped", detail=f"stopped by the operator ({self.stop_signal})")
        return 128 + signal.Signals[self.stop_signal].value


def disk_full_detail(space: Space, why: str) -> str:
    """Why a failed attempt is not restarted when the checkpoints' filesystem cannot hold one
    more checkpoint (`space.checkpoints` set)."""
    assert space.checkpoints is not None
    return (
        f"no space left on {space.path} ({space.checkpoints.one_text()}) after {why}: "
        "a restart would fail its next checkpoint; free space there, then dflashctl "
        "start HOST"
    )


def restart_detail(
    why: str, returncode: int, plan: NextRestart, policy: Policy, last_checkpoint: int | None
) -> str:
    """The `restarting` phase line's detail: why, which restart of how many, when, from where."""
    where = (
        f"from the newest checkpoint (step {last_checkpoint})"
        if last_checkpoint is not None
        else "from the newest checkpoint (none written this run)"
    )
    return (
        f"{why} (exit status {returncode}); restart {plan.number} of "
        f"{policy.max_restarts} within {policy.restart_window_s:g} s, in {plan.wait:g} s, {where}"
    )


def main(argv: list[str] | None = None) -> int:
    own, trainer = split_argv(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    args = parser.parse_args(own)
    if not trainer:
        parser.error("no trainer argv: give it after '--' (python -m trainer --config ...)")
    run_dir = args.run_dir or (Path(r) if (r := run_dir_of(trainer)) else None)
    if run_dir is None:
        parser.error("the trainer argv has no --run-dir and --run-dir was not given")
    policy = parse_policy(parser, args)
    if args.group_node is not None:
        from trainer.supervision.group import group_node_of
        from trainer.supervision.group_loop import GroupSupervisor

        try:
            node = group_node_of(trainer, args.group_node)
        except ValueError as exc:
            parser.error(str(exc))
        return GroupSupervisor(policy, node, trainer, run_dir, disk_check_s=args.disk_check_s).run()
    return Supervisor(
        policy, trainer, run_dir, disk_check_s=args.disk_check_s, child=args.child
    ).run()


if __name__ == "__main__":
    sys.exit(main())
