"""The files of a drafter export and a torch-free read of its config (`trainer.model.export`
writes and loads exports; `python -m trainer.eval` checks one here before torch loads)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from trainer.model.errors import ExportError

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
EXPORT = "export"
"""RUN/export: the drafter a run ends with (the plan's end or [schedule] max_steps)."""
EXPORT_BEST = "export-best"
"""RUN/export-best: the held-out best checkpoint's drafter, beside the last."""


def bf16_dir(out_dir: str | Path) -> Path:
    """Where the training-dtype form of the export at `out_dir` goes: `OUT-bf16` beside it."""
    out = Path(out_dir)
    return out.with_name(out.name + "-bf16")


def run_export_dirs() -> tuple[str, ...]:
    """Every directory a run exports into under RUN (each export and its -bf16 form): what the
    runner writes and the supervisor's disk watch measures."""
    return tuple(n for e in (EXPORT, EXPORT_BEST) for n in (e, bf16_dir(e).name))


def read_export_json(path: str | Path) -> dict[str, Any]:
    """The config.json of an export directory (both files present), without its weights."""
    root = Path(path)
    cfg_path = root / CONFIG
    if not cfg_path.is_file() or not (root / WEIGHTS).is_file():
        raise ExportError(f"{root}: not a drafter export (needs {CONFIG} and {WEIGHTS})")
    try:
        data = json.loads(cfg_path.read_text())
    except (OSError, UnicodeDecodeError) as err:
        raise ExportError(f"{cfg_path}: cannot read: {err}") from None
    except json.JSONDecodeError as err:
        raise ExportError(f"{cfg_path}: invalid JSON: {err}") from None
    if not isinstance(data, dict):
        raise ExportError(f"{cfg_path}: not a JSON object")
    return data
