"""One resume rule for every path that pushes a run config: compare with the checkpoint's config.

`deploy --config`, `restart` (CLI and TUI) all ask `check_config_push` before a config reaches
the host. The comparison is against the config saved in the checkpoint a resume would load (the
newest readable one, or the one named by `--resume PATH|STEP`), never against whatever was pushed
last: a config pushed by mistake must not make going back to the matching one look impossible.
`--fresh` is advised only when the checkpoint really cannot be resumed with the new config.

The checkpoint's config is read in the container by a stdlib-only script: a torch checkpoint is a
zip whose `data.pkl` holds the state dict; unpickling it with every class replaced by an inert
stub (tensors are external records, never loaded) yields the saved config in milliseconds,
without importing torch and without running any code the file names.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflashctl.config.inventory import HostConfig
from dflashctl.config.runconfig import RunConfigError, validate_config
from dflashctl.errors import DflashctlError, ExitCode, UsageError
from dflashctl.remote.transport import Transport
from trainer.config import ConfigError, TrainConfig, resume_critical_changes

# What the trainer requires of a checkpoint it resumes, from the contract both sides read, so
# the reader skips what the trainer would skip.
from trainer.events.checkpoint_layout import CHECKPOINT_VERSION, REQUIRED_KEYS

RESUME_CHOICE_RE = re.compile(r"auto|never|\d+|[^-\s;][^\s;]*")

# argv: workdir, run dir (relative to the workdir), choice (auto | STEP | PATH), version,
# required keys (comma-separated). Prints one JSON
# object: {"used": {"path", "step", "config"} | null, "skipped": [[path, reason]...], "count": n}.
# A workdir that does not exist yet (the first deploy to a host) holds no checkpoints: that is a
# report (count 0), not a failure. One that exists is the trainer's cwd, so a relative PATH
# means here what it means to the trainer.
CHECKPOINT_CONFIG_SCRIPT = r"""
import json, os, pickle, re, sys, zipfile

workdir, run, choice = sys.argv[1], sys.argv[2], sys.argv[3]
version, required = int(sys.argv[4]), sys.argv[5]
no_workdir = not os.path.isdir(workdir)
if not no_workdir:
    os.chdir(workdir)


class Stub:
    def __init__(self, *a, **k):
        pass

    def __setstate__(self, state):
        pass

    def __setitem__(self, key, value):
        pass

    def append(self, value):
        pass

    def extend(self, values):
        pass


# An OrderedDict as read here: a real state_dict() carries attributes (`_metadata`) that
# pickle restores into the instance __dict__, which a plain dict lacks.
class Mapping(dict):
    pass


class Reader(pickle.Unpickler):
    def find_class(self, module, name):
        if (module, name) == ("collections", "OrderedDict"):
            return Mapping
        return Stub

    def persistent_load(self, pid):
        return None


def saved_config(path):
    if no_workdir:
        raise ValueError("no workdir " + workdir)
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if not names:
            raise ValueError("no data.pkl in the archive")
        state = Reader(z.open(names[0])).load()
    if not isinstance(state, dict) or state.get("version") != version:
        raise ValueError("not a dflash checkpoint (version %d)" % version)
    missing = [k for k in required.split(",") if k not in state]
    if missing:
        raise ValueError("incomplete checkpoint: missing " + ", ".join(missing))
    if not isinstance(state["config"], dict):
        raise ValueError("its saved config is not a mapping")
    return state["config"]


root = os.path.join(run, "checkpoints")
found = []
if not no_workdir and os.path.isdir(root):
    for name in os.listdir(root):
        m = re.fullmatch(r"step-(\d{8,})\.pt", name)
        if m:
            found.append((int(m.group(1)), os.path.join(root, name)))
found.sort(reverse=True)
if choice == "auto":
    candidates = found
elif choice.isdigit():
    candidates = [(int(choice), os.path.join(root, "step-%08d.pt" % int(choice)))]
else:
    candidates = [(None, choice)]
used, skipped = None, []
for step, path in candidates:
    try:
        used = {"path": path, "step": step, "config": saved_config(path)}
        break
    except Exception as exc:
        reason = str(exc).splitlines()[0] if str(exc).strip() else type(exc).__name__
        skipped.append([path, reason])
print(json.dumps({"used": used, "skipped": skipped, "count": len(found)}))
"""


class ResumeRefused(DflashctlError):
    """The config cannot resume the checkpoint a resume would load (one line, names keys);
    the CLI exits 1."""

    exit_code = ExitCode.FAILED


class ResumeChoiceError(UsageError, ValueError):
    """A `--resume` value that is neither auto, never, a step nor a path (a ValueError too,
    for argparse)."""


def validate_resume_choice(value: str) -> str:
    """`--resume` as the trainer takes it: auto | never | STEP | PATH (no option-like value)."""
    if not RESUME_CHOICE_RE.fullmatch(value):
        raise ResumeChoiceError(
            f"--resume {value!r}: expected auto, never, a checkpoint step or a checkpoint path"
        )
    return value


def checkpoint_config_argv(python: str, workdir: str, choice: str) -> list[str]:
    """Run the reader in the workdir (the trainer's cwd: a relative PATH means the same)."""
    return [
        python,
        "-c",
        CHECKPOINT_CONFIG_SCRIPT,
        workdir,
        "run",
        choice,
        str(CHECKPOINT_VERSION),
        ",".join(REQUIRED_KEYS),
    ]


@dataclass(frozen=True)
class CheckpointConfig:
    """What the reader found: the checkpoint a resume would use and its saved config."""

    path: str | None = None
    step: int | None = None
    config: dict[str, Any] | None = None
    skipped: list[tuple[str, str]] = field(default_factory=list)
    count: int = 0  # checkpoints in run/checkpoints


def parse_checkpoint_report(stdout: str) -> CheckpointConfig | None:
    """The reader's JSON line; None when it printed none (python missing, no workdir)."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            raw = json.loads(line)
        except ValueError:
            continue
        if not isinstance(raw, dict):
            continue
        used = raw.get("used") or {}
        skipped = [(str(p), str(r)) for p, r in raw.get("skipped") or []]
        return CheckpointConfig(
            path=used.get("path"),
            step=used.get("step"),
            config=used.get("config"),
            skipped=skipped,
            count=int(raw.get("count") or 0),
        )
    return None


async def read_checkpoint_report(
    transport: Transport, host: HostConfig, choice: str = "auto"
) -> CheckpointConfig | str:
    """The config saved in the checkpoint `--resume choice` would load, or why the reader could
    not tell (one line: its error, or that it printed no report)."""
    res = await transport.run(
        checkpoint_config_argv(host.python, host.workdir, choice), timeout=host.command_timeout
    )
    if not res.ok:
        return res.error_line()
    return parse_checkpoint_report(res.stdout) or "the reader printed no report"


async def read_checkpoint_config(
    transport: Transport, host: HostConfig, choice: str = "auto"
) -> CheckpointConfig | None:
    """The config saved in the checkpoint `--resume choice` would load (None: cannot tell)."""
    found = await read_checkpoint_report(transport, host, choice)
    return found if isinstance(found, CheckpointConfig) else None


def breaking_keys(saved: dict[str, Any], new_path: Path) -> list[str]:
    """Resume-critical keys that differ between a checkpoint's saved config and `new_path`."""
    new = validate_config(new_path)
    try:
        old = TrainConfig.from_dict(saved, source="checkpoint config")
    except (ConfigError, ValueError) as err:
        raise RunConfigError(f"the checkpoint's saved config does not validate: {err}") from None
    return list(resume_critical_changes(old, new))


@dataclass(frozen=True)
class ResumeCheck:
    """The verdict for one config push: which checkpoint, which keys would break it."""

    checkpoint: CheckpointConfig | None
    breaking: list[str]
    notes: list[str]


async def check_config_push(
    transport: Transport,
    host: HostConfig,
    new_path: Path,
    *,
    fresh: bool,
    resume: str = "auto",
    fresh_hint: str = "--fresh",
) -> ResumeCheck:
    """Refuse (ResumeRefused) a config that cannot resume the checkpoint a resume would load.

    Nothing to resume (no checkpoint, `--fresh`, `--resume never`) is never refused. A
    checkpoint whose config cannot be read is skipped the way the trainer skips it; when none is
    readable the check cannot be made and says so in `notes` instead of guessing.
    """
    if fresh or resume == "never":
        return ResumeCheck(None, [], [])
    found = await read_checkpoint_report(transport, host, resume)
    notes: list[str] = []
    if isinstance(found, str):
        note = f"{host.name}: could not read the checkpoints' config ({found}); not compared"
        return ResumeCheck(None, [], [note])
    for path, reason in found.skipped:
        notes.append(f"{host.name}: checkpoint {path} unreadable ({reason}); not compared")
    if found.config is None:
        return ResumeCheck(found, [], notes)
    breaking = breaking_keys(found.config, new_path)
    if breaking:
        raise ResumeRefused(
            f"{host.name}: {new_path} changes {', '.join(breaking)} against the config saved in "
            f"{found.path} (the checkpoint a resume would load), which makes resuming it "
            f"impossible; use a config that matches it, or {fresh_hint} to start over "
            f"(checkpoints are archived, not deleted)"
        )
    return ResumeCheck(found, [], notes)
