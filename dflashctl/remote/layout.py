"""Every path dflashctl reads or writes under a host's workdir, named once.

    WORKDIR/
      releases/<id>/          content-addressed trainer trees (.complete once verified)
      releases/.tmp-<id>-<pid>  an unpack in progress (removed by the next unpack)
      current -> releases/<id>  what the next start runs (switched atomically)
      .current.tmp.<pid>      the new link, before `mv -T` makes it `current`
      .deploy.lock/owner      the deploy lock (mkdir) and who holds it
      .deploy-switched        a switch not yet reported back (owner, previous, new)
      run/                    the run: the trainer's --run-dir
        config.toml           the run config (deploy --config writes it)
        status.log            the trainer's status lines, appended across runs
        run-state.json        the trainer's typed record (trainer.events.run_state)
        supervisor.json       the in-container supervisor's record
        .release              the release the running trainer was started from
        checkpoints/          step-NNNNNNNN.pt
        .config.memory-check.<pid>.toml  deploy's memory check's copy of a config (removed)
      secrets/<name>          0600 files written through stdin
      measure/<id>/           one `dflashctl measure` (<id> its UTC start, 20261201T170211Z)
        info.json             what was asked (flags, release, config), written at its start
        config.toml           run/config.toml as it was measured
        tmp/                  its TMPDIR: the timing runs' directories (trainer.measure removes them)
        progress.log          trainer.measure's stderr: one `round ...` line per timing run
        stdout.txt            its stdout
        result.json table.txt  --out (table.txt written last)
        calibration.json      --save-calibration: the fitted step-cost model
        cancelled             `measure --stop` was asked (its UTC time)
        exit-status           trainer.measure's exit status (by a rename, once it exited)

      eval/<id>/ gate/<id>/   one detached job each (`dflashctl eval`, `dflashctl gate`; <id> as
                              a measure's): info.json, config.toml, key (`<release> <config
                              sha256>`), output.log (stdout and stderr), result.json, summary.json
                              (eval: the served summary the TUI shows), prompts/ (eval: the pushed
                              prompt sets), out/ (gate: its export), cancelled, exit-status
      regen/<id>/             one `dflashctl regen` job (<id> its UTC start, as a measure's)
        info.json             what was asked (the job's argv, release, servers, serve command)
        status.log            trainer.regen's lines (its --run-dir) and its supervisor's phases
        supervisor.json console.log  the in-container supervisor's record and console
        health.log            the wait for the engine's /health (--serve)
        engine.log            the serving engine's output (--serve)
        cancelled             `regen --stop` was asked (its UTC time)
        exit-status           the job's exit status (by a rename, once it exited)

A measure runs in the tmux session SESSION-measure (`measure_session`), never the run's; a job
in SESSION-eval or SESSION-gate (`dflashctl.remote.jobs`); a regeneration job in SESSION-regen
(`regen_session`): window `job` (the supervisor and trainer.regen) and, with --serve, window
`engine`.

Scripts `cd "$1"` (the workdir) and use the relative names (the module constants); services
use a `RemoteLayout(workdir)` for absolute paths. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

RUN_DIR = "run"
CONFIG = f"{RUN_DIR}/config.toml"
STATUS_LOG = f"{RUN_DIR}/status.log"
RUN_STATE = f"{RUN_DIR}/run-state.json"
SUPERVISOR_STATE = f"{RUN_DIR}/supervisor.json"
RUNNING_RELEASE = f"{RUN_DIR}/.release"
CHECKPOINTS = f"{RUN_DIR}/checkpoints"
CHECKPOINT_FILES = "step-*.pt"  # inside checkpoints/
MEMORY_CHECK_CONFIG = f"{RUN_DIR}/.config.memory-check.%d.toml"  # %d: the probe's pid
RELEASES = "releases"
RELEASE_COMPLETE = ".complete"  # inside releases/<id>: the tree was verified whole
CURRENT = "current"
DEPLOY_LOCK = ".deploy.lock"
DEPLOY_LOCK_OWNER = f"{DEPLOY_LOCK}/owner"
SWITCH_MARKER = ".deploy-switched"
SECRETS = "secrets"
DOCTOR = "doctor"  # doctor/<release>.ok: the quick checks passed for that release here
# In a release: the in-container supervisor (a tree deployed before it has none).
SUPERVISOR_SOURCE = "trainer/supervise.py"
# In a release: the memory estimator deploy's memory check runs (`python -m trainer.memory`).
MEMORY_SOURCE = "trainer/memory/__main__.py"

MEASURE_ROOT = "measure"
"""WORKDIR/measure/<id>/: one directory per measure, <id> its UTC start (MEASURE_ID_FORMAT)."""
MEASURE_ID_FORMAT = "%Y%m%dT%H%M%SZ"
"""A measure id as strftime writes it (`date -u +%Y%m%dT%H%M%SZ`): sorts by name = by start."""
MEASURE_ID_PATTERN = "^[0-9]{8}T[0-9]{6}Z$"
"""A measure id, as grep -E and re read it."""
MEASURE_SESSION_SUFFIX = "-measure"
# inside measure/<id>/
MEASURE_INFO = "info.json"  # what was asked (argv, release, config hash), written at start
MEASURE_CONFIG = "config.toml"  # a copy of run/config.toml as it was measured (for the record)
MEASURE_PROGRESS = "progress.log"  # trainer.measure's stderr: one `round ...` line per timing run
MEASURE_STDOUT = "stdout.txt"  # its stdout (the table, or the JSON with --json)
MEASURE_RESULT = "result.json"  # --out: the JSON result
MEASURE_TABLE = "table.txt"  # --out: the table (written after result.json)
MEASURE_CALIBRATION = "calibration.json"  # --save-calibration: the fitted step-cost model
MEASURE_EXIT = "exit-status"  # written (by a rename) when trainer.measure has exited
MEASURE_CANCELLED = "cancelled"  # `dflashctl measure HOST --stop` was asked (its time)
MEASURE_TMP = "tmp"  # its TMPDIR: the timing runs' directories (final checkpoints) on the workdir's
# disk, not the container's root filesystem; trainer.measure removes them, also when stopped
# In a release: it can measure (`python -m trainer.measure`).
MEASURE_SOURCE = "trainer/measure/__main__.py"


# Detached jobs (`dflashctl.remote.jobs`): one directory per job under its kind's root.
EVAL_ROOT = "eval"
GATE_ROOT = "gate"
JOB_INFO = "info.json"  # what was asked (argv, release, key), written at its start
JOB_CONFIG = "config.toml"  # run/config.toml as it was when the job started
JOB_KEY = "key"  # `<release> <sha256 of run/config.toml>`: the gate's cache key
JOB_OUTPUT = "output.log"  # the job's stdout and stderr, one stream (followed)
JOB_RESULT = "result.json"  # the job's --json
JOB_SUMMARY = "summary.json"  # eval: trainer.eval --summary-json (trainer.events.served)
JOB_PROMPTS = "prompts"  # eval: the prompt sets pushed from the operator's machine
JOB_OUT = "out"  # gate: its --out (export, prompts.jsonl)
JOB_EXPORT = "export"  # eval --checkpoint: the checkpoint's export
JOB_CANCELLED = "cancelled"  # `--stop` was asked (its UTC time)
JOB_EXIT = "exit-status"  # the job's exit status (by a rename, once it exited)
# In a release: trainer.eval with --summary-json (trainer/events/served.py came with it), and
# the gate.
EVAL_SOURCE = "trainer/events/served.py"
GATE_SOURCE = "trainer/gate/__main__.py"
REGEN_ROOT = "regen"
"""WORKDIR/regen/<id>/: one directory per regeneration job, <id> its UTC start (as a measure's)."""
REGEN_SESSION_SUFFIX = "-regen"
REGEN_JOB_WINDOW = "job"
REGEN_ENGINE_WINDOW = "engine"
# inside regen/<id>/
REGEN_INFO = "info.json"
REGEN_STATUS_LOG = "status.log"  # trainer.regen's --run-dir is regen/<id>
REGEN_SUPERVISOR = "supervisor.json"
REGEN_HEALTH_LOG = "health.log"
REGEN_ENGINE_LOG = "engine.log"
REGEN_CANCELLED = "cancelled"
REGEN_EXIT = "exit-status"
# In a release: it can regenerate (`python -m trainer.regen`).
REGEN_SOURCE = "trainer/regen/__main__.py"


def regen_session(session: str) -> str:
    """A regeneration job's tmux session: the host's session name + `-regen`."""
    return session + REGEN_SESSION_SUFFIX


def regen_dir(job_id: str) -> str:
    """regen/<id>, relative to the workdir."""
    return f"{REGEN_ROOT}/{job_id}"


def measure_session(session: str) -> str:
    """The measure's tmux session: the host's session name + `-measure` (never the run's)."""
    return session + MEASURE_SESSION_SUFFIX


def measure_dir(measure_id: str) -> str:
    """measure/<id>, relative to the workdir."""
    return f"{MEASURE_ROOT}/{measure_id}"


@dataclass(frozen=True)
class RemoteLayout:
    """Absolute paths under one workdir (a container path, never a local one)."""

    workdir: str

    def path(self, rel: str) -> str:
        return f"{self.workdir}/{rel}"

    @property
    def run_dir(self) -> str:
        return self.path(RUN_DIR)

    @property
    def config(self) -> str:
        return self.path(CONFIG)

    @property
    def status_log(self) -> str:
        return self.path(STATUS_LOG)

    @property
    def run_state(self) -> str:
        return self.path(RUN_STATE)

    @property
    def supervisor_state(self) -> str:
        return self.path(SUPERVISOR_STATE)

    @property
    def running_release(self) -> str:
        return self.path(RUNNING_RELEASE)

    @property
    def deploy_lock(self) -> str:
        return self.path(DEPLOY_LOCK)

    def release_dir(self, release: str) -> str:
        return self.path(f"{RELEASES}/{release}")

    def secret(self, name: str) -> str:
        return self.path(f"{SECRETS}/{name}")

    @property
    def current(self) -> str:
        return self.path(CURRENT)

    def doctor_stamp(self, release: str) -> str:
        return self.path(f"{DOCTOR}/{release}.ok")
