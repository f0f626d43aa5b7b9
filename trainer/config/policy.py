"""The restart policy as pure functions: how an attempt ended, what to do next, the restart argv."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from trainer.errors import ExitCode

RESTART_CHOICES = ("on-failure", "never")
# The trainer's divergence stop (runner.NonFiniteLoss / NonFiniteState): its ERROR line names it.
DIVERGENCE_MARKERS = ("NonFiniteLoss", "NonFiniteState")
# An out-of-memory error the trainer reported before dying (torch.OutOfMemoryError, MemoryError).
OOM_MARKERS = ("OutOfMemoryError", "MemoryError", "CUDA out of memory")


@dataclass(frozen=True)
class Policy:
    restart: Literal["on-failure", "never"] = "on-failure"
    max_restarts: int = 3
    restart_window_s: float = 3600.0
    stall_timeout_s: float = 900.0
    startup_timeout_s: float = 1800.0
    no_restart_exit_codes: frozenset[int] = field(default_factory=lambda: frozenset({2}))
    backoff_s: float = 10.0
    backoff_max_s: float = 300.0
    kill_grace_s: float = 60.0

    def backoff(self, restart_number: int) -> float:
        """Seconds before restart number n (1-based) of the window: doubles, capped."""
        return min(self.backoff_max_s, self.backoff_s * 2.0 ** max(0, restart_number - 1))

    def cli_args(self) -> list[str]:
        """The `python -m trainer.supervise` flags that give this policy (for dflashctl start)."""
        # str() of a float round-trips exactly (repr), which :g (6 digits) would not
        args = [
            f"--{k.replace('_', '-')}={v}"
            for k, v in self.as_json().items()
            if k != "no_restart_exit_codes"
        ]
        codes = ",".join(map(str, sorted(self.no_restart_exit_codes)))
        return [*args, f"--no-restart-exit-codes={codes}"]

    def as_json(self) -> dict[str, object]:
        return {
            "restart": self.restart,
            "max_restarts": self.max_restarts,
            "restart_window_s": self.restart_window_s,
            "stall_timeout_s": self.stall_timeout_s,
            "startup_timeout_s": self.startup_timeout_s,
            "no_restart_exit_codes": sorted(self.no_restart_exit_codes),
            "backoff_s": self.backoff_s,
            "backoff_max_s": self.backoff_max_s,
            "kill_grace_s": self.kill_grace_s,
        }


@dataclass(frozen=True)
class Ending:
    """How one attempt ended, as the supervisor observed it."""

    returncode: int  # Popen's: negative = killed by that signal
    operator_stop: bool = False  # the supervisor itself was signalled (dflashctl stop, Ctrl-C)
    stalled_s: float | None = None  # the watchdog stopped it after this timeout
    trainer_state: str | None = None  # RUN/run-state.json `state`, only when its pid is the child's
    # (or its parent is: rank 0 under torchrun); the trainer's own exit_status recorded there,
    # which torchrun's exit code hides (it turns a rank's exit 2 into 1)
    trainer_exit: int | None = None
    errors: tuple[str, ...] = ()  # ERROR messages the attempt printed to status.log
    oom_killed: bool = False  # the cgroup's oom_kill counter rose during the attempt


Verdict = Literal["finished", "stopped", "not-restarted", "failure"]


def reason(e: Ending) -> str:
    """`stalled 900 s` | `oom` | `signal 9` | `exit 1`."""
    if e.stalled_s is not None:
        return f"stalled {e.stalled_s:g} s"
    if e.oom_killed or any(m in msg for msg in e.errors for m in OOM_MARKERS):
        return "oom"
    if e.returncode < 0:
        return f"signal {-e.returncode}"
    return f"exit {e.returncode}"


def diverged(e: Ending) -> bool:
    return any(m in msg for msg in e.errors for m in DIVERGENCE_MARKERS)


def decide(e: Ending, policy: Policy) -> tuple[Verdict, str]:
    """What the ending means, with a one-line why. `failure` is a candidate for a restart."""
    if e.operator_stop:
        return "stopped", "stopped by the operator"
    if e.stalled_s is None:
        if e.returncode == 0:
            if e.trainer_state == "stopped":
                return "stopped", "the trainer was stopped by a signal (exit 0)"
            return "finished", "the trainer finished (exit 0)"
        if e.trainer_state == "stopped":
            return "stopped", f"the trainer was stopped by a signal ({reason(e)})"
        if diverged(e):
            return (
                "not-restarted",
                f"non-finite divergence ({reason(e)}): a restart would repeat it",
            )
        if ExitCode.UNSAVED in (e.returncode, e.trainer_exit):
            return (
                "not-restarted",
                f"checkpoints kept failing (exit {int(ExitCode.UNSAVED)}): a restart would train "
                "steps that cannot be kept; free space where the trainer's checkpoint errors "
                "say, then dflashctl start HOST",
            )
        if e.returncode in policy.no_restart_exit_codes:
            return "not-restarted", f"{reason(e)} is in no_restart_exit_codes"
        if e.trainer_exit is not None and e.trainer_exit in policy.no_restart_exit_codes:
            return (
                "not-restarted",
                f"the trainer's exit {e.trainer_exit} (launcher {reason(e)}) is in "
                "no_restart_exit_codes",
            )
    if policy.restart == "never":
        return "not-restarted", f"{reason(e)}; restart = never"
    return "failure", reason(e)


def exit_code(returncode: int) -> int:
    """The supervisor's own exit status for a child's: a signal death is 128 + N, like a shell."""
    return 128 - returncode if returncode < 0 else returncode


def run_dir_of(argv: Sequence[str]) -> str | None:
    """The value of the trainer's `--run-dir` (either spelling), or None."""
    for i, a in enumerate(argv):
        if a == "--run-dir" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--run-dir="):
            return a.split("=", 1)[1]
    return None


CHILDREN = ("trainer", "regen")
"""What the supervisor runs: the trainer, or a regeneration job (python -m trainer.regen)."""


def regen_restart_argv(argv: Sequence[str]) -> list[str]:
    """A regeneration job's restart: the same argv with `--resume` (it skips the rows already
    in OUT or its errors file; without it, the job would refuse the OUT it left)."""
    return list(argv) if "--resume" in argv else [*argv, "--resume"]


def restart_argv(argv: Sequence[str], wrote_checkpoint: bool) -> list[str]:
    """The argv of a restart: never `--fresh`; `--resume auto` (the newest usable checkpoint,
    also the trainer's default, so an argv without `--resume` gets none added).

    An explicit `--resume PATH|STEP` is kept only while this run has written no checkpoint of its
    own (auto would then find none and start over, dropping the checkpoint the operator chose).
    """
    out: list[str] = []
    given: str | None = None
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--fresh":
            i += 1
        elif a == "--resume" and i + 1 < len(argv):
            given, i = argv[i + 1], i + 2
        elif a.startswith("--resume="):
            given, i = a.split("=", 1)[1], i + 1
        else:
            out.append(a)
            i += 1
    if given is None:
        return out  # the trainer's default is --resume auto
    explicit = given not in ("auto", "never")
    return [*out, "--resume", given if explicit and not wrote_checkpoint else "auto"]
