"""Pure argv and script builders for detached jobs: `dflashctl eval` and `dflashctl gate`.

A job is one command of the deployed release run in a tmux session of its own (the host's
session + `-eval` / `-gate`, never the training session), so it outlives the SSH link and the
client. Everything it leaves is under `WORKDIR/<kind>/<id>/` (<id> its UTC start, as a
measure's): `info.json`, `config.toml` (run/config.toml as it was), `key` (`<release>
<sha256 of run/config.toml>`), `output.log` (its stdout and stderr), `result.json` (its --json),
`exit-status` once it exited, `cancelled` when `--stop` ended it. The newest directory is "the"
job of its kind. Parsing what these print is `dflashctl.jobs.control`'s.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass

from dflashctl.errors import UsageError
from dflashctl.remote import layout as L
from dflashctl.remote.layout import MEASURE_ID_PATTERN
from dflashctl.remote.run import MARK
from dflashctl.remote.tmux import SETTLED_PANE_FN, TMUX_SOCKET

JOB_TICK_S = 0.5
"""The status wait polls every JOB_TICK_S (a gate takes seconds, an eval minutes)."""


@dataclass(frozen=True)
class JobKind:
    """One kind of detached job: its command word, root directory and what a release needs."""

    name: str  # "eval" | "gate": the dflashctl command, the session suffix
    root: str  # WORKDIR/<root>/<id>/
    source: str  # a file the release ships when it can run this kind
    module: str  # the trainer module it runs (for messages)

    def session(self, host_session: str) -> str:
        return f"{host_session}-{self.name}"

    def dir(self, job_id: str) -> str:
        """<root>/<id>, relative to the workdir."""
        return f"{self.root}/{job_id}"


EVAL = JobKind("eval", L.EVAL_ROOT, L.EVAL_SOURCE, "trainer.eval")
GATE = JobKind("gate", L.GATE_ROOT, L.GATE_SOURCE, "trainer.gate")


def check_job_id(job_id: str) -> str:
    if not re.match(MEASURE_ID_PATTERN, job_id):
        raise UsageError(f"{job_id!r} is not a job id (like 20261201T170211Z)")
    return job_id


# $1 workdir $2 root. Creates <root>/<id> (one job per second at most, retried), copies the run
# config into it (when there is one), writes `key`, stdin to info.json, prints the id.
PREPARE_SCRIPT = f"""set -e
cd "$1"
mkdir -p "$2"
i=0
while :; do
  id=$(date -u +{L.MEASURE_ID_FORMAT})
  mkdir "$2/$id" 2>/dev/null && break
  i=$((i + 1)); [ "$i" -lt 3 ] || {{ echo "cannot create $2/$id" >&2; exit 1; }}
  sleep 1
done
d="$2/$id"
rel=$(readlink {L.CURRENT} 2>/dev/null || true)
if [ -f {L.CONFIG} ]; then
  cp {L.CONFIG} "$d/{L.JOB_CONFIG}"
  sum=$(sha256sum "$d/{L.JOB_CONFIG}" | cut -c1-64)
else
  sum=none
fi
echo "${{rel##*/}} $sum" > "$d/{L.JOB_KEY}"
cat > "$d/.{L.JOB_INFO}.tmp"
mv -f "$d/.{L.JOB_INFO}.tmp" "$d/{L.JOB_INFO}"
echo "$id"
"""


def prepare_argv(workdir: str, kind: JobKind) -> list[str]:
    """Make a new job directory (stdin: its info.json); prints its id."""
    return ["sh", "-c", PREPARE_SCRIPT, f"dflash-{kind.name}-prepare", workdir, kind.root]


# The pane's command. $1 workdir $2 <root>/<id>, then the job's argv: its stdout and stderr into
# output.log, then its exit status, published by a rename once it has exited.
RUN_SCRIPT = f"""cd "$1" || exit 1
d=$2; shift 2
"$@" > "$d/{L.JOB_OUTPUT}" 2>&1
rc=$?
echo "$rc" > "$d/.{L.JOB_EXIT}.tmp" && mv -f "$d/.{L.JOB_EXIT}.tmp" "$d/{L.JOB_EXIT}"
exit "$rc"
"""


def run_argv(workdir: str, kind: JobKind, job_id: str, command: Sequence[str]) -> list[str]:
    """What the job's pane runs: `command` with its output kept and its exit status recorded."""
    return ["sh", "-c", RUN_SCRIPT, f"dflash-{kind.name}", workdir, kind.dir(job_id), *command]


def chain(first: Sequence[str], then: Sequence[str]) -> list[str]:
    """`first`, and when it succeeds, `then` (exec'd): one argv for a job of two steps. The
    first command is quoted once into the script (shlex), the second passed as arguments."""
    return ["sh", "-c", f'{shlex.join(first)} && exec "$@"', "dflash-chain", *then]


# $1 workdir $2 the job's tmux session $3 the first output line wanted (1-based) $4 max ticks
# $5 root $6 the source a release needs [$7 a job id]. Waits (up to $4 ticks) on the newest job
# (or $7) until it has output line $3, its exit status, or a pane that is not alive; then one
# MARK-sectioned report of it, with what a start needs to know (`current`, whether it ships the
# job's source).
STATUS_SCRIPT = (
    SETTLED_PANE_FN
    + 'm="'
    + MARK
    + '"; cd "$1" 2>/dev/null || { echo "${m}noworkdir"; exit 0; }\n'
    + f"new=$(ls -1 \"$5\" 2>/dev/null | grep -E '{MEASURE_ID_PATTERN}' | tail -n 1)\n"
    + 'id=${7:-$new}; [ -n "$id" ] && [ -d "$5/$id" ] || id=""\n'
    + 'sess=$2; [ "$id" = "$new" ] || sess="-"\n'  # an older job: the session is not its
    + 'd="$5/$id"; i=0\n'
    + f'while [ -n "$id" ] && [ "$i" -lt "$4" ] && [ ! -f "$d/{L.JOB_EXIT}" ]; do\n'
    + f'  n=$(wc -l < "$d/{L.JOB_OUTPUT}" 2>/dev/null || echo 0); [ "$n" -lt "$3" ] || break\n'
    + f"  dead=$(tmux -L {TMUX_SOCKET} display-message -p -t \"=$sess:\" '#{{pane_dead}}' "
    + "2>/dev/null || echo gone)\n"
    + '  [ "$dead" = 0 ] || break\n'
    + f"  i=$((i + 1)); sleep {JOB_TICK_S:g}\n"
    + "done\n"
    + 'echo "${m}now"; date -u +%s\n'
    + 'echo "${m}id"; echo "$id"\n'
    + 'echo "${m}pane"; settled_pane "$sess"\n'
    + f'echo "${{m}}exit"; [ -z "$id" ] || cat "$d/{L.JOB_EXIT}" 2>/dev/null\n'
    + f'echo "${{m}}cancelled"; [ -z "$id" ] || cat "$d/{L.JOB_CANCELLED}" 2>/dev/null\n'
    + f'echo "${{m}}info"; [ -z "$id" ] || cat "$d/{L.JOB_INFO}" 2>/dev/null; echo\n'
    + f'echo "${{m}}key"; [ -z "$id" ] || cat "$d/{L.JOB_KEY}" 2>/dev/null\n'
    + f'echo "${{m}}result"; [ -z "$id" ] || [ ! -f "$d/{L.JOB_RESULT}" ] || echo yes\n'
    + f'echo "${{m}}output"; [ -z "$id" ] || tail -n +"$3" "$d/{L.JOB_OUTPUT}" 2>/dev/null\n'
    + f'echo "${{m}}current"; readlink {L.CURRENT} 2>/dev/null\n'
    + f'echo "${{m}}runnable"; [ -f {L.CURRENT}/"$6" ] && echo yes || echo no\n'
    + "exit 0\n"
)


def status_argv(
    workdir: str,
    kind: JobKind,
    host_session: str,
    from_line: int = 0,
    wait_s: float = 0,
    job_id: str | None = None,
) -> list[str]:
    """The newest job of `kind` (or `job_id`) in one round trip (MARK sections), after waiting
    up to `wait_s` for its output line past 0-based `from_line` or its end."""
    ticks = max(0, int(wait_s / JOB_TICK_S))
    argv = ["sh", "-c", STATUS_SCRIPT, f"dflash-{kind.name}-status", workdir]
    argv += [kind.session(host_session), str(from_line + 1), str(ticks), kind.root, kind.source]
    return [*argv, check_job_id(job_id)] if job_id is not None else argv


def cancel_argv(workdir: str, kind: JobKind, job_id: str) -> list[str]:
    """Record that the job was stopped on purpose (its UTC time), before its session ends."""
    script = f'cd "$1" && [ -d "$2" ] && date -u +%Y-%m-%dT%H:%M:%SZ > "$2/{L.JOB_CANCELLED}"'
    return ["sh", "-c", script, f"dflash-{kind.name}-cancel", workdir, kind.dir(job_id)]


# $1 workdir $2 root. The key of run/config.toml and `current` now, then the newest job of the
# root whose key is that and whose exit status is 0 (nothing when none): the gate's cache.
PASSED_SCRIPT = f"""cd "$1" 2>/dev/null || exit 0
rel=$(readlink {L.CURRENT} 2>/dev/null || true)
if [ -f {L.CONFIG} ]; then sum=$(sha256sum {L.CONFIG} | cut -c1-64); else sum=none; fi
key="${{rel##*/}} $sum"
echo "{MARK}key"; echo "$key"
echo "{MARK}passed"
for id in $(ls -1 "$2" 2>/dev/null | grep -E '{MEASURE_ID_PATTERN}' | sort -r); do
  [ "$(cat "$2/$id/{L.JOB_EXIT}" 2>/dev/null)" = 0 ] || continue
  [ "$(cat "$2/$id/{L.JOB_KEY}" 2>/dev/null)" = "$key" ] || continue
  echo "$id"; break
done
"""


def passed_argv(workdir: str, kind: JobKind) -> list[str]:
    """The current key (release + config sha256) and the newest job of `kind` that exited 0
    with that key (the gate's cache: a pass is kept per release and config)."""
    return ["sh", "-c", PASSED_SCRIPT, f"dflash-{kind.name}-passed", workdir, kind.root]
