"""Pure argv and script builders for the run: its status round trip, the trainer's argv (under
torchrun when the run config needs several ranks), the start and stop waits, the GPU query, and
a measure's (its directory and tmux session, the pane's wrapper, its status wait). Parsing their
output into typed results is run control's (dflashctl.runs.control) and the measure service's
(dflashctl.runs.measure); the paths and names are dflashctl.remote.layout's.
"""

from __future__ import annotations

import re

from dflashctl.errors import UsageError
from dflashctl.remote import layout as L
from dflashctl.remote.layout import (
    MEASURE_CANCELLED,
    MEASURE_CONFIG,
    MEASURE_EXIT,
    MEASURE_ID_PATTERN,
    MEASURE_INFO,
    MEASURE_PROGRESS,
    MEASURE_ROOT,
    MEASURE_SOURCE,
    MEASURE_STDOUT,
    MEASURE_TABLE,
    MEASURE_TMP,
    measure_dir,
    measure_session,
)
from dflashctl.remote.regen import REGEN_LOG_LINES, WINDOW_FN
from dflashctl.remote.tmux import SETTLED_PANE_FN, TMUX_SOCKET
from trainer.events import PHASE_TEXTS

MARK = "@@dflash@@:"
"""Starts each section of the status script's output (`@@dflash@@:NAME`)."""

STATUS_MEASURE_LINES = 5
"""The status script reads this many of a running measure's last progress lines (status shows
the last that is not blank)."""

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
    # the newest measure, only while it has no exit status: its id, its session's pane, its
    # last progress lines and the host's clock (a finished one is `measure --result`'s)
    f'echo "${{m}}measure"; mid=$(ls -1 {MEASURE_ROOT} 2>/dev/null | grep -E '
    f"'{MEASURE_ID_PATTERN}' | tail -n 1)\n"
    f'if [ -n "$mid" ] && [ ! -f "{MEASURE_ROOT}/$mid/{MEASURE_EXIT}" ]; then echo "$mid"\n'
    f'  echo "${{m}}measure_pane"; settled_pane "$2{L.MEASURE_SESSION_SUFFIX}"\n'
    f'  echo "${{m}}measure_progress"; tail -n {STATUS_MEASURE_LINES} '
    f'"{MEASURE_ROOT}/$mid/{MEASURE_PROGRESS}" 2>/dev/null\n'
    '  echo "${m}now"; date -u +%s\n'
    "fi\n"
    # an eval or gate job running now (the newest of its kind, no exit status, its session's
    # pane alive): start, restart and measure refuse while one uses the devices
    f"for k in {L.EVAL_ROOT} {L.GATE_ROOT}; do\n"
    f"  jid=$(ls -1 \"$k\" 2>/dev/null | grep -E '{MEASURE_ID_PATTERN}' | tail -n 1)\n"
    f'  [ -n "$jid" ] && [ ! -f "$k/$jid/{L.JOB_EXIT}" ] || continue\n'
    '  case "$(settled_pane "$2-$k")" in 0\\|*)\n'
    '    echo "${m}job"; echo "$k $jid"; echo "${m}job_now"; date -u +%s\n'
    f'    echo "${{m}}job_progress"; tail -n 3 "$k/$jid/{L.JOB_OUTPUT}" 2>/dev/null; break;;\n'
    "  esac\n"
    "done\n"
    # the newest `dflashctl eval` that left a summary (trainer.events.served), and what it
    # evaluated: the TUI shows served tau beside the in-training one
    f"sid=$(ls -1 {L.EVAL_ROOT} 2>/dev/null | grep -E '{MEASURE_ID_PATTERN}' | sort -r | "
    f'while read -r d; do [ -f "{L.EVAL_ROOT}/$d/{L.JOB_SUMMARY}" ] && {{ echo "$d"; break; }}; '
    "done)\n"
    'if [ -n "$sid" ]; then echo "${m}served_id"; echo "$sid"; echo "${m}served_now"; '
    "date -u +%s\n"
    f'  echo "${{m}}served"; cat "{L.EVAL_ROOT}/$sid/{L.JOB_SUMMARY}" 2>/dev/null; echo\n'
    f'  echo "${{m}}served_info"; cat "{L.EVAL_ROOT}/$sid/{L.JOB_INFO}" 2>/dev/null; echo\n'
    "fi\n"
    # the newest regeneration job, whatever its state (status, the TUI and watch show it)
    f"rid=$(ls -1 {L.REGEN_ROOT} 2>/dev/null | grep -E '{MEASURE_ID_PATTERN}' | tail -n 1)\n"
    'echo "${m}regen"; echo "$rid"\n'
    'if [ -n "$rid" ]; then s="$2'
    + L.REGEN_SESSION_SUFFIX
    + '"; rd="'
    + L.REGEN_ROOT
    + '/$rid"\n'
    + "  "
    + WINDOW_FN
    + f'  echo "${{m}}regen_pane"; window {L.REGEN_JOB_WINDOW}\n'
    f'  echo "${{m}}regen_engine"; window {L.REGEN_ENGINE_WINDOW}\n'
    f'  echo "${{m}}regen_exit"; cat "$rd/{L.REGEN_EXIT}" 2>/dev/null\n'
    f'  echo "${{m}}regen_cancelled"; cat "$rd/{L.REGEN_CANCELLED}" 2>/dev/null\n'
    f'  echo "${{m}}regen_info"; cat "$rd/{L.REGEN_INFO}" 2>/dev/null; echo\n'
    f'  echo "${{m}}regen_supervisor"; cat "$rd/{L.REGEN_SUPERVISOR}" 2>/dev/null; echo\n'
    f'  echo "${{m}}regen_log"; tail -n {REGEN_LOG_LINES} "$rd/{L.REGEN_STATUS_LOG}" 2>/dev/null\n'
    '  echo "${m}regen_now"; date -u +%s\n'
    "fi\n"
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


# --- measure (`python -m trainer.measure` in its own tmux session) -------------------------

# $1 workdir. Creates measure/<id> (a new one: one measure per second at most, retried), copies
# the run config into it, writes stdin to its info.json, prints the id. Exit 3: no run config.
MEASURE_PREPARE_SCRIPT = f"""set -e
cd "$1"
[ -f {L.CONFIG} ] || {{ echo "no {L.CONFIG}" >&2; exit 3; }}
mkdir -p {MEASURE_ROOT}
i=0
while :; do
  id=$(date -u +{L.MEASURE_ID_FORMAT})
  mkdir "{MEASURE_ROOT}/$id" 2>/dev/null && break
  i=$((i + 1)); [ "$i" -lt 3 ] || {{ echo "cannot create {MEASURE_ROOT}/$id" >&2; exit 1; }}
  sleep 1
done
cp {L.CONFIG} "{MEASURE_ROOT}/$id/{MEASURE_CONFIG}"
mkdir "{MEASURE_ROOT}/$id/{MEASURE_TMP}"
cat > "{MEASURE_ROOT}/$id/.{MEASURE_INFO}.tmp"
mv -f "{MEASURE_ROOT}/$id/.{MEASURE_INFO}.tmp" "{MEASURE_ROOT}/$id/{MEASURE_INFO}"
echo "$id"
"""


def measure_prepare_argv(workdir: str) -> list[str]:
    """Make a new measure directory (stdin: its info.json); prints its id."""
    return ["sh", "-c", MEASURE_PREPARE_SCRIPT, "dflash-measure-prepare", workdir]


# The pane's command. $1 workdir $2 measure/<id>, then trainer.measure's argv: stdout and stderr
# into files there, then the exit status, published by a rename once it has exited.
MEASURE_RUN_SCRIPT = f"""cd "$1" || exit 1
d=$2; shift 2
"$@" > "$d/{MEASURE_STDOUT}" 2> "$d/{MEASURE_PROGRESS}"
rc=$?
echo "$rc" > "$d/.{MEASURE_EXIT}.tmp" && mv -f "$d/.{MEASURE_EXIT}.tmp" "$d/{MEASURE_EXIT}"
exit "$rc"
"""


def measure_run_argv(workdir: str, measure_id: str, measure: list[str]) -> list[str]:
    """What the measure's pane runs: `measure` (trainer.measure's argv) with its output kept."""
    return [
        "sh",
        "-c",
        MEASURE_RUN_SCRIPT,
        "dflash-measure",
        workdir,
        measure_dir(measure_id),
        *measure,
    ]


MEASURE_TICK_S = 1.0
"""The measure wait polls every MEASURE_TICK_S (a measure takes minutes to hours)."""

# $1 workdir $2 the measure's tmux session $3 the first progress line wanted (1-based) $4 max
# ticks. Waits (up to $4 ticks) on the newest measure until it has progress line $3, its exit
# status or a pane that is not alive; then one MARK-sectioned report of it. The release checks
# are there for a start (what `current` is, and whether it ships trainer.measure).
MEASURE_STATUS_SCRIPT = (
    SETTLED_PANE_FN
    + 'm="'
    + MARK
    + '"; cd "$1" 2>/dev/null || { echo "${m}noworkdir"; exit 0; }\n'
    + f"new=$(ls -1 {MEASURE_ROOT} 2>/dev/null | grep -E '{MEASURE_ID_PATTERN}' | tail -n 1)\n"
    + 'id=${5:-$new}; [ -n "$id" ] && [ -d "'
    + MEASURE_ROOT
    + '/$id" ] || id=""\n'
    + '[ "$id" = "$new" ] || set -- "$1" "-" "$3" "$4"\n'  # an older one: the session is not its
    + f'd="{MEASURE_ROOT}/$id"; i=0\n'
    + f'while [ -n "$id" ] && [ "$i" -lt "$4" ] && [ ! -f "$d/{MEASURE_EXIT}" ]; do\n'
    + f'  n=$(wc -l < "$d/{MEASURE_PROGRESS}" 2>/dev/null || echo 0); [ "$n" -lt "$3" ] || break\n'
    + f"  dead=$(tmux -L {TMUX_SOCKET} display-message -p -t \"=$2:\" '#{{pane_dead}}' "
    + "2>/dev/null || echo gone)\n"
    + '  [ "$dead" = 0 ] || break\n'
    + f"  i=$((i + 1)); sleep {MEASURE_TICK_S:g}\n"
    + "done\n"
    + 'echo "${m}now"; date -u +%s\n'
    + 'echo "${m}id"; echo "$id"\n'
    + 'echo "${m}pane"; settled_pane "$2"\n'
    + f'echo "${{m}}exit"; [ -z "$id" ] || cat "$d/{MEASURE_EXIT}" 2>/dev/null\n'
    + f'echo "${{m}}cancelled"; [ -z "$id" ] || cat "$d/{MEASURE_CANCELLED}" 2>/dev/null\n'
    + f'echo "${{m}}info"; [ -z "$id" ] || cat "$d/{MEASURE_INFO}" 2>/dev/null; echo\n'
    + f'echo "${{m}}table"; [ -z "$id" ] || [ ! -f "$d/{MEASURE_TABLE}" ] || echo yes\n'
    + f'echo "${{m}}progress"; [ -z "$id" ] || tail -n +"$3" "$d/{MEASURE_PROGRESS}" 2>/dev/null\n'
    + f'echo "${{m}}current"; readlink {L.CURRENT} 2>/dev/null\n'
    + f'echo "${{m}}measurable"; [ -f {L.CURRENT}/{MEASURE_SOURCE} ] && echo yes || echo no\n'
    + "exit 0\n"
)


def measure_status_argv(
    workdir: str,
    session: str,
    from_line: int = 0,
    wait_s: float = 0,
    measure_id: str | None = None,
) -> list[str]:
    """The newest measure (or `measure_id`) in one round trip (MARK sections), after waiting
    up to `wait_s` for its progress line past 0-based `from_line` or its end; `session` is the
    host's session. The measure session's pane counts only for the newest measure."""
    if measure_id is not None and not re.match(MEASURE_ID_PATTERN, measure_id):
        raise UsageError(f"{measure_id!r} is not a measure id (like 20261201T170211Z)")
    ticks = max(0, int(wait_s / MEASURE_TICK_S))
    argv = ["sh", "-c", MEASURE_STATUS_SCRIPT, "dflash-measure-status", workdir]
    argv += [measure_session(session), str(from_line + 1), str(ticks)]
    return [*argv, measure_id] if measure_id is not None else argv


def measure_cancel_argv(workdir: str, measure_id: str) -> list[str]:
    """Record that the measure was stopped on purpose (its UTC time), before its session ends."""
    script = f'cd "$1" && [ -d "$2" ] && date -u +%Y-%m-%dT%H:%M:%SZ > "$2/{MEASURE_CANCELLED}"'
    return ["sh", "-c", script, "dflash-measure-cancel", workdir, measure_dir(measure_id)]
