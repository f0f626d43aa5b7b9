"""The run config seen from dflashctl: validate, hash and diff through `trainer.config`.

`trainer.config` is torch-free and the single authority on what a valid config is and what
its hash is; dflashctl never re-implements either. Text from the container is written to a
temp file so `TrainConfig.load` reports errors the same way for both sides.
"""

from __future__ import annotations

import difflib
import tempfile
from pathlib import Path

from dflashctl.errors import ExitCode, UsageError
from trainer.config import ConfigError, TrainConfig, config_hash, resume_critical_changes


class RunConfigError(UsageError):
    """The run config is invalid (message names the file and key); the CLI exits 2."""

    exit_code = ExitCode.USAGE


def read_config_text(path: Path) -> str:
    """The config file's text; RunConfigError (one line, file and byte offset) if not UTF-8."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise RunConfigError(f"{path}: run config not found") from None
    except OSError as err:
        raise RunConfigError(f"{path}: cannot read: {err.strerror or err}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise RunConfigError(
            f"{path}: not UTF-8 text at byte {err.start} (line {line}): "
            f"invalid byte 0x{data[err.start]:02x}"
        ) from None


def validate_config(path: Path) -> TrainConfig:
    """Load `path` with TrainConfig.load; RunConfigError on any problem."""
    if not path.is_file():
        raise RunConfigError(f"{path}: run config not found")
    read_config_text(path)  # a non-UTF-8 file is named with its byte offset, whatever the loader
    try:
        return TrainConfig.load(path)
    except ConfigError as err:
        raise RunConfigError(str(err)) from None


def _load_text(text: str, name: str) -> TrainConfig:
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / name
        p.write_text(text, encoding="utf-8")
        return validate_config(p)


def load_config_text(text: str) -> TrainConfig:
    """A config from its text (a remote file's); RunConfigError naming the key when invalid.
    Its relative paths resolve against a temporary directory: join them to the file's own
    directory where it lives (`data_paths`)."""
    return _load_text(text, "remote-config.toml")


def config_hash_of_file(path: Path) -> str:
    return config_hash(validate_config(path))


def config_hash_of_text(text: str) -> str | None:
    """Hash of a config's text (None if it does not validate: a remote file we only show)."""
    try:
        return config_hash(_load_text(text, "remote-config.toml"))
    except RunConfigError:
        return None


def resume_breaking_changes(old_text: str, new_path: Path) -> list[str]:
    """Dotted keys whose change makes `--resume auto` impossible (empty if old is invalid)."""
    try:
        old = _load_text(old_text, "remote-config.toml")
    except RunConfigError:
        return []
    return list(resume_critical_changes(old, validate_config(new_path)))


def config_diff(old_text: str, new_text: str, *, old_name: str, new_name: str) -> str:
    """Unified diff shown before a restart replaces the remote config."""
    return "".join(
        difflib.unified_diff(
            old_text.splitlines(keepends=True),
            new_text.splitlines(keepends=True),
            fromfile=old_name,
            tofile=new_name,
        )
    )


def drafter_device_count(text: str) -> int:
    """How many ranks a node runs for this config (torchrun's `--nproc-per-node`; the trainer
    refuses any other count): its `topology.drafter_devices` entries, plus its
    `target_devices` entries with `topology.targets = "shared"` (each target device is a rank
    of its own there, serving every drafter rank)."""
    topo = _load_text(text, "remote-config.toml").topology
    shared = len(topo.target_devices) if topo.targets == "shared" else 0
    return len(topo.drafter_devices) + shared
