"""Pure argv builders for a regeneration job in the container (`dflashctl regen`): its
directory, its tmux session (window `job`: a wrapper around the in-container supervisor running
`python -m trainer.regen`; window `engine` with --serve), its status report and its stop.

The job's wrapper (`REGEN_RUN_SCRIPT`), with --serve, first waits for the engine's /health
(`python -m trainer.serving.health`, which fails at once when the engine window's process
exits), then runs the job, then stops the engine (SIGTERM to its process group, SIGKILL after
30 s) and publishes the job's exit status by a rename: finished, failed, gave up, stopped and
lost are told apart without a client. Parsing the reports is `dflashctl.runs.regen`'s.
"""

from __future__ import annotations

import re

from dflashctl.errors import UsageError
from dflashctl.remote import layout as L
from dflashctl.remote.layout import (
    MEASURE_ID_PATTERN,
    REGEN_CANCELLED,
    REGEN_ENGINE_LOG,
    REGEN_ENGINE_WINDOW,
    REGEN_EXIT,
    REGEN_HEALTH_LOG,
    REGEN_INFO,
    REGEN_JOB_WINDOW,
    REGEN_ROOT,
    REGEN_SOURCE,
    REGEN_STATUS_LOG,
    REGEN_SUPERVISOR,
    regen_dir,
)
from dflashctl.remote.tmux import (
    HISTORY_LIMIT,
    PANE_FORMAT,
    PANE_HEIGHT,
    PANE_WIDTH,
    tmux,
    tmux_literal,
)

REGEN_LOG_LINES = 60
"""The status reports read this many of the job's last status.log lines."""
ENGINE_STOP_TICKS = 300  # x 0.1 s: SIGTERM, then SIGKILL to what is left of the engine

# $1 workdir. Creates regen/<id> (one per second at most, retried), writes stdin to its
# info.json, prints the id.
REGEN_PREPARE_SCRIPT = f"""set -e
cd "$1"
mkdir -p {REGEN_ROOT}
i=0
while :; do
  id=$(date -u +{L.MEASURE_ID_FORMAT})
  mkdir "{REGEN_ROOT}/$id" 2>/dev/null && break
  i=$((i + 1)); [ "$i" -lt 3 ] || {{ echo "cannot create {REGEN_ROOT}/$id" >&2; exit 1; }}
  sleep 1
done
cat > "{REGEN_ROOT}/$id/.{REGEN_INFO}.tmp"
mv -f "{REGEN_ROOT}/$id/.{REGEN_INFO}.tmp" "{REGEN_ROOT}/$id/{REGEN_INFO}"
echo "$id"
"""


def regen_prepare_argv(workdir: str) -> list[str]:
    """Make a new job directory (stdin: its info.json); prints its id."""
    return ["sh", "-c", REGEN_PREPARE_SCRIPT, "dflash-regen-prepare", workdir]


# The job window's command. $1 workdir $2 regen/<id> $3 the job's tmux session $4 the engine URL
# to wait for ("": no --serve) $5 python $6 the health wait's limit, then the job's argv.
REGEN_RUN_SCRIPT = f"""cd "$1" || exit 1
d=$2; s=$3; url=$4; py=$5; limit=$6; shift 6
publish() {{ echo "$1" > "$d/.{REGEN_EXIT}.tmp" && mv -f "$d/.{REGEN_EXIT}.tmp" "$d/{REGEN_EXIT}"; }}
engine() {{ tmux -L dflash list-panes -s -t "=$s" -F "#{{window_name}} $1" 2>/dev/null | sed -n 's/^{REGEN_ENGINE_WINDOW} //p' | head -n 1; }}
stop_engine() {{
  p=$(engine '#{{pane_dead}} #{{pane_pid}}')
  [ -n "$p" ] || return 0
  set -- $p
  [ "$1" = 0 ] && [ "$2" != "$$" ] || return 0
  echo "stopping the engine (pid $2)"
  kill -TERM -- "-$2" 2>/dev/null || kill -TERM "$2" 2>/dev/null
  i=0
  while [ "$i" -lt {ENGINE_STOP_TICKS} ] && kill -0 "$2" 2>/dev/null; do sleep 0.1; i=$((i + 1)); done
  kill -KILL -- "-$2" 2>/dev/null
  return 0
}}
if [ -n "$url" ]; then
  pid=$(engine '#{{pane_pid}}')
  "$py" -m trainer.serving.health --url "$url" --timeout-s "$limit" ${{pid:+--pid "$pid"}} \\
    --log "$d/{REGEN_ENGINE_LOG}" > "$d/{REGEN_HEALTH_LOG}" 2>&1
  rc=$?
  cat "$d/{REGEN_HEALTH_LOG}"
  if [ "$rc" -ne 0 ]; then
    grep '^ERROR: ' "$d/{REGEN_HEALTH_LOG}" >> "$d/{REGEN_STATUS_LOG}"
    stop_engine; publish "$rc"; exit "$rc"
  fi
fi
"$@"
rc=$?
stop_engine
publish "$rc"
exit "$rc"
"""


def regen_run_argv(
    workdir: str,
    job_id: str,
    session: str,
    wait_url: str,
    python: str,
    limit_s: float,
    job: list[str],
) -> list[str]:
    """What the job window runs: `job` (the supervisor's argv), after the engine's health wait
    when `wait_url` is set, its exit status kept."""
    return [
        "sh",
        "-c",
        REGEN_RUN_SCRIPT,
        "dflash-regen",
        workdir,
        regen_dir(job_id),
        session,
        wait_url,
        python,
        f"{limit_s:g}",
        *job,
    ]


def engine_window_command(workdir: str, job_id: str, serve: list[str]) -> list[str]:
    """The engine window's command: `serve` with its output in the job's engine.log."""
    script = 'cd "$1" && log="$2" && shift 2 && exec "$@" > "$log" 2>&1'
    log = f"{regen_dir(job_id)}/{REGEN_ENGINE_LOG}"
    return ["sh", "-c", script, "dflash-engine", workdir, log, *serve]


def regen_session_argv(
    session: str,
    windows: list[tuple[str, list[str]]],
    *,
    cwd: str,
    env: dict[str, str],
) -> list[str]:
    """One tmux command sequence: the session with its first window, then the others (`-d`:
    the job's window stays where attach lands). Options come first, so a window whose process
    dies at once still keeps its exit status (remain-on-exit). The last window is the current
    one (where an attach lands)."""
    env_args: list[str] = []
    for key, value in env.items():
        env_args += ["-e", tmux_literal(f"{key}={value}")]
    (first, command), rest = windows[0], windows[1:]
    argv = tmux(
        "start-server", ";",
        "set-option", "-g", "remain-on-exit", "on", ";",
        "set-option", "-g", "history-limit", str(HISTORY_LIMIT), ";",
        "new-session", "-d", "-s", tmux_literal(session), "-n", first,
        "-x", str(PANE_WIDTH), "-y", str(PANE_HEIGHT), "-c", tmux_literal(cwd), *env_args,
        *(tmux_literal(a) for a in command),
    )  # fmt: skip
    for name, command in rest:
        argv += [";", "new-window", "-t", f"={tmux_literal(session)}:", "-n", name]
        argv += ["-c", tmux_literal(cwd), *env_args, *(tmux_literal(a) for a in command)]
    return argv


REGEN_TICK_S = 1.0
# $1 workdir $2 the job's tmux session $3 the first status.log line wanted (1-based) $4 max
# ticks $5 a job id (default: the newest). Waits (up to $4 ticks) until the job's status.log
# has line $3, its exit status, or a dead or missing job window; then one report of it.
WINDOW_FN = (
    f'window() {{ tmux -L dflash list-panes -s -t "=$s" -F "#{{window_name}}|{PANE_FORMAT}" '
    '2>/dev/null | sed -n "s/^$1|//p" | head -n 1; }\n'
)
"""`window NAME` prints the PANE_FORMAT line of the job session's ($s) window NAME, nothing
when it has none (by name from list-panes: a display-message target naming a missing window
answers for the current one)."""
REGEN_STATUS_SCRIPT = (
    f'm="@@dflash@@:"; cd "$1" 2>/dev/null || {{ echo "${{m}}noworkdir"; exit 0; }}\n'
    f"new=$(ls -1 {REGEN_ROOT} 2>/dev/null | grep -E '{MEASURE_ID_PATTERN}' | tail -n 1)\n"
    f'id=${{5:-$new}}; [ -n "$id" ] && [ -d "{REGEN_ROOT}/$id" ] || id=""\n'
    's=$2; [ "$id" = "$new" ] || s="-"\n'  # an older job: the session is not its
    + WINDOW_FN
    + f'd="{REGEN_ROOT}/$id"; i=0\n'
    f'while [ -n "$id" ] && [ "$i" -lt "$4" ] && [ ! -f "$d/{REGEN_EXIT}" ]; do\n'
    f'  n=$(wc -l < "$d/{REGEN_STATUS_LOG}" 2>/dev/null || echo 0); [ "$n" -lt "$3" ] || break\n'
    f'  case "$(window {REGEN_JOB_WINDOW})" in 0\\|*) ;; *) break;; esac\n'
    f"  i=$((i + 1)); sleep {REGEN_TICK_S:g}\n"
    "done\n"
    'echo "${m}now"; date -u +%s\n'
    'echo "${m}id"; echo "$id"\n'
    f'echo "${{m}}pane"; window {REGEN_JOB_WINDOW}\n'
    f'echo "${{m}}engine"; window {REGEN_ENGINE_WINDOW}\n'
    f'echo "${{m}}exit"; [ -z "$id" ] || cat "$d/{REGEN_EXIT}" 2>/dev/null\n'
    f'echo "${{m}}cancelled"; [ -z "$id" ] || cat "$d/{REGEN_CANCELLED}" 2>/dev/null\n'
    f'echo "${{m}}info"; [ -z "$id" ] || cat "$d/{REGEN_INFO}" 2>/dev/null; echo\n'
    f'echo "${{m}}supervisor"; [ -z "$id" ] || cat "$d/{REGEN_SUPERVISOR}" 2>/dev/null; echo\n'
    f'echo "${{m}}log_lines"; [ -z "$id" ] || wc -l < "$d/{REGEN_STATUS_LOG}" 2>/dev/null\n'
    f'echo "${{m}}log"; [ -z "$id" ] || tail -n {REGEN_LOG_LINES} "$d/{REGEN_STATUS_LOG}" 2>/dev/null\n'
    f'echo "${{m}}new"; [ -z "$id" ] || tail -n +"$3" "$d/{REGEN_STATUS_LOG}" 2>/dev/null | head -n 500\n'
    f'echo "${{m}}current"; readlink {L.CURRENT} 2>/dev/null\n'
    f'echo "${{m}}capable"; [ -f {L.CURRENT}/{REGEN_SOURCE} ] && echo yes || echo no\n'
    "exit 0\n"
)


def regen_status_argv(
    workdir: str, session: str, from_line: int = 0, wait_s: float = 0, job_id: str | None = None
) -> list[str]:
    """The newest job (or `job_id`) in one round trip, after waiting up to `wait_s` for its
    status.log line past 0-based `from_line` or its end; `session` is the job's session."""
    if job_id is not None and not re.match(MEASURE_ID_PATTERN, job_id):
        raise UsageError(f"{job_id!r} is not a regeneration job id (like 20261201T170211Z)")
    ticks = max(0, int(wait_s / REGEN_TICK_S))
    argv = ["sh", "-c", REGEN_STATUS_SCRIPT, "dflash-regen-status", workdir, session]
    argv += [str(from_line + 1), str(ticks)]
    return [*argv, job_id] if job_id is not None else argv


# $1 workdir $2 regen/<id>: record the stop, then SIGINT the supervisor (it forwards it once to
# trainer.regen, which stops; the wrapper then stops the engine). Prints the pid signalled.
REGEN_STOP_SCRIPT = f"""cd "$1" && [ -d "$2" ] || exit 3
date -u +%Y-%m-%dT%H:%M:%SZ > "$2/{REGEN_CANCELLED}"
pid=$(sed -n 's/.*"pid": *\\([0-9][0-9]*\\).*/\\1/p' "$2/{REGEN_SUPERVISOR}" 2>/dev/null | head -n 1)
[ -n "$pid" ] && kill -INT "$pid" 2>/dev/null && echo "$pid"
exit 0
"""


def regen_stop_argv(workdir: str, job_id: str) -> list[str]:
    return ["sh", "-c", REGEN_STOP_SCRIPT, "dflash-regen-stop", workdir, regen_dir(job_id)]
