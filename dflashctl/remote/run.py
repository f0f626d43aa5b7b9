"""Pure argv and script builders for the run: its status round trip, the trainer's argv (under
torchrun when the run config needs several ranks), the start and stop waits, the GPU query. Parsing their output into typed results is run control's
(dflashctl.control); the paths are dflashctl.remote.layout's.
"""

from __future__ import annotations

import re

from dflashctl.errors import UsageError
from dflashctl.remote import layout as L
from dflashctl.remote.tmux import SETTLED_PANE_FN, TMUX_SOCKET
from trainer.events import PHASE_TEXTS

MARK = "@@dflash@@:"
"""Starts each section of the status script's output (`@@dflash@@:NAME`)."""

# $1 workdir $2 session. Sections, each after a MARK line.
STATUS_SCRIPT = (
    SETTLED_PANE_FN + 'm="' + MARK + '"; cd "$1" 2>/dev/null || { echo "${m}noworkdir"; exit 0; }\n'
    f'echo "${{m}}session"; tmux -L {TMUX_SOCKET} has-session -t "=$2" 2>/dev/null '
    "&& echo yes || echo no\n"
    'echo "${m}pane"; settled_pane "$2"\n'
    f'echo "${{m}}current"; readlink {L.CURRENT} 2>/dev/null\n'
    f'echo "${{m}}run_release"; cat {L.RUNNING_RELEASE} 2>/dev/null\n'
    f'echo "${{m}}run_state"; cat {L.RUN_STATE} 2>/dev/null; echo\n'
    f'echo "${{m}}log_lines"; wc -l < {L.STATUS_LOG} 2>/dev/null || echo 0\n'
    f'echo "${{m}}log"; tail -n 400 {L.STATUS_LOG} 2>/dev/null; echo\n'
    f'echo "${{m}}config"; cat {L.CONFIG} 2>/dev/null; echo\n'
    f'echo "${{m}}capture"; tmux -L {TMUX_SOCKET} capture-pane -p -J -t "=$2:" -S -60 '
    "2>/dev/null\n"
    f'echo "${{m}}switched"; cat {L.SWITCH_MARKER} 2>/dev/null\n'
    f'echo "${{m}}supervisor"; cat {L.SUPERVISOR_STATE} 2>/dev/null; echo\n'
    f'echo "${{m}}supervisable"; [ -f {L.CURRENT}/{L.SUPERVISOR_SOURCE} ] && echo yes || echo no\n'
    "exit 0\n"
)


def status_argv(workdir: str, session: str) -> list[str]:
    """Everything `status` shows, in one round trip (MARK-delimited sections)."""
    return ["sh", "-c", STATUS_SCRIPT, "dflash-status", workdir, session]


def trainer_argv(python: str, fresh: bool, resume: str = "auto") -> list[str]:
    """The trainer's argv; `resume` is passed as given (auto | never | STEP | PATH)."""
    argv = [python, "-m", "trainer", "--config", L.CONFIG, "--run-dir", L.RUN_DIR]
    return [*argv, "--fresh"] if fresh else [*argv, "--resume", resume]


TORCHRUN_MODULE = "torch.distributed.run"
"""torchrun as `python -m`: the container's clean PATH need not hold its console script."""


def standalone_launcher(python: str, nproc: int) -> list[str]:
    """torchrun on one node, up to the program: `--standalone` (a local rendezvous on a free
    port), `nproc` ranks, and no restarts of its own (restarts are the supervisor's)."""
    return [
        python,
        "-m",
        TORCHRUN_MODULE,
        "--standalone",
        "--nproc-per-node",
        str(nproc),
        "--max-restarts",
        "0",
    ]


def host_trainer_argv(python: str, fresh: bool, resume: str = "auto", nproc: int = 1) -> list[str]:
    """A single-host start's argv: `trainer_argv` for one rank; for `nproc` > 1 (the run
    config's rank count) the same trainer arguments under `standalone_launcher`."""
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise UsageError(f"rank count {nproc!r} is not a positive integer")
    argv = trainer_argv(python, fresh, resume)
    return argv if nproc == 1 else [*standalone_launcher(python, nproc), *argv[1:]]


GPU_QUERY = "index,name,utilization.gpu,memory.used,memory.total,temperature.gpu,power.draw"


def gpu_query_argv() -> list[str]:
    """nvidia-smi's per-GPU CSV of GPU_QUERY (no header, no units)."""
    return ["nvidia-smi", f"--query-gpu={GPU_QUERY}", "--format=csv,noheader,nounits"]


# --- waiting on the pane and status.log ------------------------------------------------------

TICK_S = 0.2
"""The wait scripts poll the pane and status.log every TICK_S."""

# A line that shows the trainer got past its setup (device, data, target, checkpoint loaded).
READY_PATTERN = (
    "^("
    + "|".join(re.escape(PHASE_TEXTS[p]) for p in ("starting", "running"))
    + r"|\[[0-9]+m\] step=)"
)

# The supervisor's line for a failed attempt it restarts (trainer.supervise): a start whose
# trainer died at once is still a failed start, even though the pane lives on.
RESTARTING_PATTERN = "^" + re.escape(PHASE_TEXTS["restarting"])

# Both wait scripts: $1 workdir $2 session $3 first status.log line to scan (1-based)
# $4 max ticks of TICK_S; `pane_dead` is "gone" without the session.
_PANE_DEAD = (
    f"dead=$(tmux -L {TMUX_SOCKET} display-message -p -t \"=$2:\" '#{{pane_dead}}' "
    "2>/dev/null || echo gone)"
)

# $5 READY_PATTERN $6 RESTARTING_PATTERN. Prints exited | restarting | ready | waiting.
START_WAIT_SCRIPT = f"""cd "$1"
i=0
while :; do
  {_PANE_DEAD}
  if [ "$dead" != 0 ]; then echo "exited"; break; fi
  from=$3; n=$(wc -l < {L.STATUS_LOG} 2>/dev/null || echo 0)
  [ "$n" -ge $((from - 1)) ] || from=1
  if tail -n +"$from" {L.STATUS_LOG} 2>/dev/null | grep -q -E "$6"; then echo "restarting"; break; fi
  if tail -n +"$from" {L.STATUS_LOG} 2>/dev/null | grep -q -E "$5"; then echo "ready"; break; fi
  i=$((i + 1))
  if [ "$i" -ge "$4" ]; then echo "waiting"; break; fi
  sleep {TICK_S}
done
"""

# Prints exited | checkpointed (25 ticks after the trainer's checkpoint line, for it to exit) |
# timeout.
STOP_WAIT_SCRIPT = f"""cd "$1"
i=0; seen=""
while :; do
  {_PANE_DEAD}
  if [ "$dead" != 0 ]; then echo "exited"; break; fi
  if [ -z "$seen" ] && tail -n +"$3" {L.STATUS_LOG} 2>/dev/null | grep -q '^Checkpoint saved: '; then
    seen=$i
  fi
  if [ -n "$seen" ] && [ $((i - seen)) -ge 25 ]; then echo "checkpointed"; break; fi
  i=$((i + 1))
  if [ "$i" -ge "$4" ]; then echo "timeout"; break; fi
  sleep {TICK_S}
done
"""

_WAIT_SCRIPTS = {"dflash-start-wait": START_WAIT_SCRIPT, "dflash-stop": STOP_WAIT_SCRIPT}


def pane_wait_argv(
    name: str, workdir: str, session: str, from_line: int, seconds: float, *patterns: str
) -> list[str]:
    """Run wait script `name` (a key of _WAIT_SCRIPTS) for up to `seconds`, scanning
    status.log from 0-based `from_line`; `patterns` are its extra arguments."""
    ticks = max(1, int(seconds / TICK_S))
    script = _WAIT_SCRIPTS[name]
    return ["sh", "-c", script, name, workdir, session, str(from_line + 1), str(ticks), *patterns]


def start_wait_argv(workdir: str, session: str, from_line: int, wait_s: float) -> list[str]:
    """Wait until the trainer is past its setup, restarting or exited (or `wait_s` passed)."""
    return pane_wait_argv(
        "dflash-start-wait",
        workdir,
        session,
        from_line,
        wait_s,
        READY_PATTERN,
        RESTARTING_PATTERN,
    )


def stop_wait_argv(workdir: str, session: str, from_line: int, timeout: float) -> list[str]:
    """Wait until the interrupted trainer exited or checkpointed (or `timeout` passed)."""
    return pane_wait_argv("dflash-stop", workdir, session, from_line, timeout)
