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
# In a release: the in-container supervisor (a tree deployed before it has none).
SUPERVISOR_SOURCE = "trainer/supervise.py"
# In a release: the memory estimator deploy's memory check runs (`python -m trainer.memory`).
MEMORY_SOURCE = "trainer/memory/__main__.py"


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
