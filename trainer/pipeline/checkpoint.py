"""Checkpoints: atomic on disk, complete enough to resume bit-for-bit, pruned to the last N.

A checkpoint is one file `RUN/checkpoints/step-XXXXXXXX.pt` holding the drafter, optimizer,
sampler position, every rank's RNG states, counters, and the config it was written under. It is
written to a temp name in the same directory, fsynced, renamed, and the directory fsynced: a
crash or SIGKILL mid-save leaves the previous checkpoints intact and never a half file under the
final name. `--fresh` archives the old directory to `checkpoints.old-<timestamp>`; nothing is
ever deleted except checkpoints older than the newest `keep_last`.
"""

from __future__ import annotations

import contextlib
import os
import random
import re
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

CHECKPOINT_VERSION = 1
_NAME = re.compile(r"step-(\d{8,})\.pt")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; one line naming the file."""


def checkpoint_dir(run_dir: Path) -> Path:
    return run_dir / "checkpoints"


def checkpoint_path(run_dir: Path, step: int) -> Path:
    return checkpoint_dir(run_dir) / f"step-{step:08d}.pt"


def list_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints (temp files excluded), oldest first."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _NAME.fullmatch(p.name))]
    return sorted(found)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_checkpoint(run_dir: Path, step: int, state: dict[str, Any], keep_last: int) -> Path:
    """Write `state` atomically as step-`step`.pt, then prune to the newest `keep_last`."""
    root = checkpoint_dir(run_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = checkpoint_path(run_dir, step)
    tmp = root / f".{final.name}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as fh:
            torch.save({"version": CHECKPOINT_VERSION, **state}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, final)
        _fsync_dir(root)
    finally:
        tmp.unlink(missing_ok=True)
    for _, old in list_checkpoints(run_dir)[:-keep_last]:
        # A failed purge must never take the run down; the next save retries.
        with contextlib.suppress(OSError):
            old.unlink()
    return final


def load_checkpoint(path: Path) -> dict[str, Any]:
    """Load a checkpoint on CPU; CheckpointError (one line) if unreadable or foreign."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=False)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint") from None
    except Exception as exc:
        raise CheckpointError(f"{path}: cannot load checkpoint: {exc}".splitlines()[0]) from None
    if not isinstance(state, dict) or state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path}: not a dflash checkpoint (version {CHECKPOINT_VERSION})")
    return state


def archive_checkpoints(run_dir: Path) -> Path | None:
    """Move RUN/checkpoints aside to checkpoints.old-<UTC timestamp> (for --fresh)."""
    root = checkpoint_dir(run_dir)
    if not root.is_dir() or not any(root.iterdir()):
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    dest = run_dir / f"checkpoints.old-{stamp}"
    n = 1
    while dest.exists():
        dest = run_dir / f"checkpoints.old-{stamp}-{n}"
        n += 1
    os.replace(root, dest)
    return dest


def rng_state(gen: torch.Generator) -> dict[str, Any]:
    """Every RNG a step consumes, so a resumed rank draws exactly what it would have."""
    state: dict[str, Any] = {
        "anchor": gen.get_state(),
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(gen: torch.Generator, state: dict[str, Any]) -> None:
    gen.set_state(state["anchor"])
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
