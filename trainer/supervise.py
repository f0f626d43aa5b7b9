"""`python -m trainer.supervise [OPTIONS] -- python -m trainer --config C --run-dir RUN ...`

Runs the trainer as a child and keeps it running: a failed attempt (a non-zero exit, a signal
death, a stall) is restarted from the newest checkpoint (`--resume auto`, never `--fresh`) after
a backoff that doubles per restart, at most `--max-restarts` times within `--restart-window-s`;
then it gives up, once. Never restarted: a finished run, a stop (the supervisor or the trainer
was signalled), an exit status in `--no-restart-exit-codes`, the trainer's non-finite divergence
stop. Stall watchdog: no new step, checkpoint or phase line in RUN/status.log for
`--stall-timeout-s` (`--startup-timeout-s` before the first step) -> /proc snapshot and the
trainer's thread stacks (SIGUSR1, faulthandler) into RUN/console.log, SIGINT, SIGKILL after
`--kill-grace-s`, then the policy.

Disk: free space in RUN against the newest checkpoint's size times the checkpoints retention
keeps (the trainer argv's `--config`: checkpoint.keep_last + the best when it evaluates + the one
being written, less those already there; one checkpoint without a readable config), at start,
every `--disk-check-s` while the trainer runs (a `low_disk` phase line once per change,
`low_disk` in the state; the trainer is not stopped for it), and before every restart (less than
one checkpoint: not restarted, since the restart would fail its first checkpoint the same way).

Signals: the trainer runs in its own session, so a Ctrl-C in the tmux pane reaches it exactly
once, forwarded by the supervisor (SIGINT, SIGTERM, SIGHUP). A signal during a backoff ends the
supervisor without another attempt. State: RUN/supervisor.json (this process is its only
writer); events: phase lines on stdout, RUN/status.log and RUN/console.log.

Exit status: the last attempt's (a signal death is 128 + N), 2 for a usage error.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, TextIO

from trainer.config.policy import (
    RESTART_CHOICES,
    Ending,
    Policy,
    decide,
    exit_code,
    restart_argv,
    run_dir_of,
)
from trainer.errors import ExitCode
from trainer.events import format_error_line, format_phase_line
from trainer.supervision import disk, procinfo
from trainer.supervision.progress import LogTail, Progress
from trainer.supervision.statefile import now_iso, read_trainer_state, write_state

TICK_S = 0.1
FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
PREFIX = "Supervisor: "
DISK_CHECK_S = 30.0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= 0")
    return int(text)


def _codes(text: str) -> frozenset[int]:
    parts = [p.strip() for p in text.split(",") if p.strip()]
    bad = [p for p in parts if not p.isdigit() or not 0 < int(p) < 256]
    if bad:
        raise argparse.ArgumentTypeError(f"{bad[0]!r} is not an exit status 1-255")
    return frozenset(int(p) for p in parts)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.supervise",
        usage="%(prog)s [OPTIONS] -- TRAINER_ARGV...",
        description=__doc__.splitlines()[0],
    )
    d = Policy()
    p.add_argument("--restart", choices=RESTART_CHOICES, default=d.restart)
    p.add_argument("--max-restarts", type=_count, default=d.max_restarts)
    p.add_argument("--restart-window-s", type=_positive, default=d.restart_window_s)
    p.add_argument("--stall-timeout-s", type=_positive, default=d.stall_timeout_s)
    p.add_argument(
        "--startup-timeout-s",
        type=_positive,
        help=f"before the first step (default: the larger of {d.startup_timeout_s:g} and the "
        "stall timeout)",
    )
    p.add_argument(
        "--no-restart-exit-codes",
        type=_codes,
        default=d.no_restart_exit_codes,
        help="comma-separated exit statuses never restarted (default: 2, usage/config errors)",
    )
    p.add_argument("--backoff-s", type=_positive, default=d.backoff_s, help="first backoff")
    p.add_argument("--backoff-max-s", type=_positive, default=d.backoff_max_s)
    p.add_argument("--kill-grace-s", type=_positive, default=d.kill_grace_s)
    p.add_argument("--run-dir", type=Path, help="default: the trainer argv's --run-dir")
    p.add_argument(
        "--disk-check-s",
        type=_positive,
        default=DISK_CHECK_S,
        help="seconds between free-space checks of the run directory while the trainer runs",
    )
    return p


def _set_parent_death_signal() -> None:
    # Runs in the child before exec: if the supervisor is SIGKILLed, the trainer gets SIGTERM
    # (a graceful stop) instead of running on orphaned, outside the tmux session.
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGTERM), 0, 0, 0)  # PR_SET_PDEATHSIG


class Supervisor:
    def __init__(
        self,
        policy: Policy,
        argv: list[str],
        run_dir: Path,
        out: TextIO = sys.stdout,
        disk_check_s: float = DISK_CHECK_S,
    ) -> None:
        self.policy, self.argv, self.run_dir, self.out = policy, argv, run_dir, out
        self.disk_check_s = disk_check_s
        self.retention = disk.RetentionReader(disk.config_of(argv))
        self._retention_problem: str | None = None
        self.disk_checked = -float("inf")  # monotonic time of the last free-space check
        self.child: subprocess.Popen[bytes] | None = None
        self.stop_signal: str | None = None
        self.signals = 0
        self.attempt = 0
        self.restarts: list[dict[str, Any]] = []
        self.failures: list[tuple[float, str]] = []  # (monotonic time, reason) of every failure
        self.restart_times: list[float] = []  # monotonic time of each restart
        self.wrote_checkpoint = False
        self.state: dict[str, Any] = {
            "pid": os.getpid(),
            "started_at": now_iso(),
            "policy": policy.as_json(),
            "argv": argv,
            "state": "starting",
            "attempt": 0,
            "trainer_pid": None,
            "restarts": self.restarts,
            "gave_up": False,
            "detail": None,
            "exit_status": None,
            "low_disk": None,  # {free_mib, needed_mib, since} while free < one checkpoint
        }
        self._write_problem: str | None = None

    # ------------------------------------------------------------------ output
    def say(self, text: str, status_log: bool = False) -> None:
        """A line on stdout and in console.log (and status.log for events the parser reads)."""
        with contextlib.suppress(OSError):  # the pane may be gone (SIGHUP): the files remain
            print(text, file=self.out, flush=True)
        for name in ("console.log", "status.log") if status_log else ("console.log",):
            try:
                with open(self.run_dir / name, "a") as fh:
                    fh.write(text + "\n")
            except OSError as exc:
                print(
                    format_error_line(f"{self.run_dir / name}: cannot append: {exc}"), file=self.out
                )

    def save(self, **fields: Any) -> None:
        self.state.update(fields)
        problem = write_state(self.run_dir, self.state)
        if problem and problem != self._write_problem:
            print(format_error_line(problem), file=self.out, flush=True)
        self._write_problem = problem

    # ------------------------------------------------------------------ disk
    def check_disk(self) -> disk.Disk | None:
        """Free space against one checkpoint; a phase line and the state entry on each change."""
        self.disk_checked = time.monotonic()
        retention = self.retention.read()
        if retention.problem != self._retention_problem and retention.problem:
            self.say(
                f"{PREFIX}no checkpoint retention from the config ({retention.problem}): free "
                "space is checked against one checkpoint"
            )
        self._retention_problem = retention.problem
        d = disk.check(self.run_dir, retention)
        if d is None:
            return None
        was = self.state["low_disk"]
        if d.low:
            since = was["since"] if was else now_iso()
            entry = {**d.as_json(), "since": since}
            if was is None:
                self.say(
                    format_phase_line(
                        "low_disk",
                        f"low: {d.text()} on {self.run_dir}; "
                        + ("the next checkpoint" if d.full else "a later checkpoint")
                        + " will fail unless space is freed",
                    ),
                    status_log=True,
                )
            if entry != was:
                self.save(low_disk=entry)
        elif was is not None:
            self.say(
                format_phase_line("low_disk", f"ok again: {d.text()} on {self.run_dir}"),
                status_log=True,
            )
            self.save(low_disk=None)
        return d

    # ------------------------------------------------------------------ signals
    def _on_signal(self, signum: int, _frame: object) -> None:
        self.signals += 1
        self.stop_signal = self.stop_signal or signal.Signals(signum).name
        child = self.child
        # returncode, not poll(): no reaping inside a handler. Until the child is reaped its pid
        # cannot be reused, so the kill reaches the child or its zombie.
        if child is not None and child.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child.pid, signum)  # one per signal received: the child has its own pgrp
                os.kill(child.pid, signal.SIGCONT)  # a SIGSTOPped child must see it too

    def install_signals(self) -> None:
        for s in FORWARDED:
            signal.signal(s, self._on_signal)

    # ------------------------------------------------------------------ one attempt
    def _spawn(self, argv: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(argv, start_new_session=True, preexec_fn=_set_parent_death_signal)

    def _wait(self, child: subprocess.Popen[bytes], seconds: float) -> bool:
        """Wait up to `seconds` for the child to exit; True when it did."""
        deadline = time.monotonic() + seconds
        while child.poll() is None:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(TICK_S, max(0.0, deadline - time.monotonic())))
        return True

    def _stop_stalled(self, child: subprocess.Popen[bytes], idle_s: float, limit: float) -> None:
        pid = child.pid
        self.save(state="stalled", detail=f"no progress for {idle_s:.0f} s (limit {limit:g} s)")
        self.say(
            f"{PREFIX}trainer pid {pid} made no progress in status.log for {idle_s:.0f} s "
            f"(limit {limit:g} s): /proc snapshot, thread stacks, then SIGINT"
        )
        for line in procinfo.snapshot(pid):
            self.say(f"{PREFIX}{line}")
        if procinfo.is_stopped(pid):
            self.say(f"{PREFIX}pid {pid} is stopped (SIGSTOP): sending SIGCONT so it can dump")
            os.kill(pid, signal.SIGCONT)
        if procinfo.catches(pid, signal.SIGUSR1):
            self.say(f"{PREFIX}thread stacks of pid {pid} (faulthandler, SIGUSR1) follow")
            os.kill(pid, signal.SIGUSR1)
            self._wait(child, 1.0)
        else:
            self.say(f"{PREFIX}no stack dump: pid {pid} has no SIGUSR1 handler (faulthandler)")
        if child.poll() is None:
            os.kill(pid, signal.SIGINT)
            if not self._wait(child, self.policy.kill_grace_s):
                self.say(
                    f"{PREFIX}pid {pid} still alive {self.policy.kill_grace_s:g} s after "
                    "SIGINT: SIGKILL"
                )
                child.kill()
                child.wait()

    def run_attempt(self, argv: list[str]) -> tuple[Ending, Progress]:
        log = self.run_dir / "status.log"
        tail = LogTail(log, LogTail.size(log))
        oom_before = procinfo.oom_kills()
        self.attempt += 1
        child = self.child = self._spawn(argv)
        if self.stop_signal is not None:  # it came while the child was being created
            os.kill(child.pid, signal.SIGINT)
        progress = Progress(time.monotonic())
        self.save(state="running", attempt=self.attempt, trainer_pid=child.pid, detail=None)
        stalled: float | None = None
        while child.poll() is None:
            time.sleep(TICK_S)
            now = time.monotonic()
            self._feed(tail, progress, now)
            if now - self.disk_checked >= self.disk_check_s:
                self.check_disk()
            if self.stop_signal is not None:
                continue  # a stop is the trainer's to finish; the watchdog stands down
            limit = progress.idle_limit(self.policy.stall_timeout_s, self.policy.startup_timeout_s)
            idle = now - progress.last_progress
            if idle > limit and child.poll() is None:
                stalled = limit
                self._stop_stalled(child, idle, limit)
        self._feed(tail, progress, time.monotonic())
        oom_after = procinfo.oom_kills()
        ending = Ending(
            returncode=child.returncode,
            operator_stop=self.stop_signal is not None,
            stalled_s=stalled,
            trainer_state=read_trainer_state(self.run_dir, child.pid),
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
        if self.restarts and before is None and progress.resumed_step is not None:
            self.restarts[-1]["resumed_step"] = progress.resumed_step
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
                self.say(f"{PREFIX}{why}")
                self.save(state="finished", detail=why, exit_status=status)
                return status
            if verdict == "stopped":
                by = f" ({self.stop_signal})" if ending.operator_stop else ""
                self.say(f"{PREFIX}{why}{by}: not restarting")
                self.save(state="stopped", detail=why, exit_status=status)
                return status
            if verdict == "not-restarted":
                self.say(format_phase_line("not_restarting", why), status_log=True)
                self.save(state="not-restarted", detail=why, exit_status=status)
                return status
            space = self.check_disk()
            if space is not None and space.full:
                detail = (
                    f"no space left on {self.run_dir} ({space.one_text()}) after {why}: a restart "
                    f"would fail its next checkpoint; free space there, then dflashctl start HOST"
                )
                self.say(format_phase_line("not_restarting", detail), status_log=True)
                self.save(
                    state="not-restarted", detail=detail, exit_status=status or ExitCode.FAILED
                )
                return status or ExitCode.FAILED
            now = time.monotonic()
            self.failures.append((now, why))
            window = self.policy.restart_window_s
            recent = [t for t in self.restart_times if now - t <= window]
            if len(recent) >= self.policy.max_restarts:
                counted = [f for f in self.failures if now - f[0] <= window]
                span = now - counted[0][0] if len(counted) > 1 else 0.0
                detail = f"after {len(recent)} restarts in {span:.0f} s: " + ", ".join(
                    r for _, r in counted
                )
                self.say(format_phase_line("gave_up", detail), status_log=True)
                self.save(
                    state="gave-up",
                    gave_up=True,
                    detail=f"gave up {detail}",
                    exit_status=status or ExitCode.FAILED,
                )
                return status or ExitCode.FAILED
            number = len(recent) + 1
            wait = self.policy.backoff(number)
            argv = restart_argv(self.argv, self.wrote_checkpoint)
            record = {
                "at": now_iso(),
                "attempt": self.attempt + 1,
                "reason": why,
                "exit_status": ending.returncode,
                "signal": signal.Signals(-ending.returncode).name
                if ending.returncode < 0
                else None,
                "checkpoint_step": last_checkpoint,
                "resumed_step": None,
                "backoff_s": wait,
            }
            self.restarts.append(record)
            self.restart_times.append(now)
            where = (
                f"from the newest checkpoint (step {last_checkpoint})"
                if last_checkpoint is not None
                else "from the newest checkpoint (none written this run)"
            )
            self.say(
                format_phase_line(
                    "restarting",
                    f"{why} (exit status {ending.returncode}); restart {number} of "
                    f"{self.policy.max_restarts} within {window:g} s, in {wait:g} s, {where}",
                ),
                status_log=True,
            )
            self.save(state="restarting", detail=f"{why}: restart {number} in {wait:g} s")
            if not self._backoff(wait):
                why = f"stopped by the operator ({self.stop_signal}) during the restart backoff"
                self.say(f"{PREFIX}{why}: not restarting")
                self.save(state="stopped", detail=why, exit_status=status)
                return status
        self.save(state="stopped", detail=f"stopped by the operator ({self.stop_signal})")
        return 128 + signal.Signals[self.stop_signal].value


def _split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        return argv, []
    i = argv.index("--")
    return argv[:i], argv[i + 1 :]


def parse_policy(parser: argparse.ArgumentParser, args: argparse.Namespace) -> Policy:
    """The Policy the parsed flags give; a contradiction is a usage error (exit 2)."""
    if args.startup_timeout_s is None:
        args.startup_timeout_s = max(Policy().startup_timeout_s, args.stall_timeout_s)
    if args.startup_timeout_s < args.stall_timeout_s:
        parser.error(
            f"--startup-timeout-s {args.startup_timeout_s:g} is shorter than "
            f"--stall-timeout-s {args.stall_timeout_s:g}"
        )
    return Policy(
        restart=args.restart,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window_s,
        stall_timeout_s=args.stall_timeout_s,
        startup_timeout_s=args.startup_timeout_s,
        no_restart_exit_codes=args.no_restart_exit_codes,
        backoff_s=args.backoff_s,
        backoff_max_s=args.backoff_max_s,
        kill_grace_s=args.kill_grace_s,
    )


def main(argv: list[str] | None = None) -> int:
    own, trainer = _split_argv(list(sys.argv[1:] if argv is None else argv))
    parser = _parser()
    args = parser.parse_args(own)
    if not trainer:
        parser.error("no trainer argv: give it after '--' (python -m trainer --config ...)")
    run_dir = args.run_dir or (Path(r) if (r := run_dir_of(trainer)) else None)
    if run_dir is None:
        parser.error("the trainer argv has no --run-dir and --run-dir was not given")
    policy = parse_policy(parser, args)
    return Supervisor(policy, trainer, run_dir, disk_check_s=args.disk_check_s).run()


if __name__ == "__main__":
    sys.exit(main())
