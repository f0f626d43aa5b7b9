"""`python -m trainer.export --checkpoint PATH|best|latest [--run-dir RUN] --out DIR`.

Writes the drafter of any checkpoint as a finished run writes its own: `DIR` in the fp32 master
weights and `DIR-bf16` in the training dtype, each in the z-lab layout (`config.json`,
`model.safetensors`, `dflash.py`; see `trainer.model.export`). `best` is RUN/checkpoints/best.pt
(kept by `[eval]`), `latest` the newest step file of RUN. The drafter's shape comes from the
config saved in the checkpoint and the target's `config.json` (its `model.target_dir`, or
`--target DIR` when that path does not hold here); the target's weights are not read.

Exit status: 0 written; 2 a usage or input error (one line naming the file); 130 interrupted
(files are written under temporary names and renamed, so no half export looks complete).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from trainer.errors import ExitCode, TrainerError
from trainer.model.export_files import bf16_dir

NAMED = ("best", "latest")


class ExportCliError(TrainerError):
    """An argument or file the export cannot use; one line."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer.export", description=__doc__.splitlines()[0].strip("`.")
    )
    p.add_argument(
        "--checkpoint",
        required=True,
        help="a checkpoint file, or 'best' / 'latest' of --run-dir",
    )
    p.add_argument("--run-dir", type=Path, help="the run directory (for best and latest)")
    p.add_argument("--out", required=True, type=Path, help="export directory (fp32); DIR-bf16 too")
    p.add_argument(
        "--target",
        type=Path,
        help="target model directory (default: the model.target_dir saved in the checkpoint)",
    )
    p.add_argument("--force", action="store_true", help="write into non-empty export directories")
    return p


def check_arguments(args: argparse.Namespace) -> None:
    """Everything that needs no torch: the names given, the run dir, the output directories."""
    if args.checkpoint in NAMED:
        if args.run_dir is None:
            raise ExportCliError(f"--checkpoint {args.checkpoint} needs --run-dir RUN")
        if not args.run_dir.is_dir():
            raise ExportCliError(f"--run-dir {args.run_dir}: not a directory")
    elif not Path(args.checkpoint).is_file():
        raise ExportCliError(f"--checkpoint {args.checkpoint}: no such file (or best, latest)")
    if args.target is not None and not (args.target / "config.json").is_file():
        raise ExportCliError(f"--target {args.target}: no config.json (not a model directory)")
    if not args.force:
        for out in (args.out, bf16_dir(args.out)):
            if out.is_dir() and any(out.iterdir()):
                raise ExportCliError(f"{out}: exists and is not empty (--force writes into it)")
            if out.exists() and not out.is_dir():
                raise ExportCliError(f"{out}: exists and is not a directory")


def resolve_checkpoint(name: str, run_dir: Path | None) -> Path:
    """The checkpoint file `name` means: a path, or best/latest of `run_dir`."""
    from trainer.pipeline import checkpoint

    if name not in NAMED:
        return Path(name)
    assert run_dir is not None  # check_arguments
    if name == "best":
        best = checkpoint.best_checkpoint(run_dir)
        if best is None:
            link = checkpoint.checkpoint_dir(run_dir) / checkpoint.BEST
            raise ExportCliError(f"{link}: no best checkpoint (kept by [eval] while training)")
        return best[1]
    found = checkpoint.list_checkpoints(run_dir)
    if not found:
        raise ExportCliError(f"{checkpoint.checkpoint_dir(run_dir)}: no checkpoint")
    return found[-1][1]


def export_checkpoint(path: Path, out: Path, target: Path | None = None) -> tuple[int, Path, Path]:
    """Export the drafter of checkpoint `path` to `out` and `out`-bf16: (step, fp32, bf16)."""
    from trainer.config import ConfigError, TrainConfig
    from trainer.model.drafter import DFlashDrafter
    from trainer.model.export import export_forms
    from trainer.pipeline import assets, checkpoint

    state = checkpoint.load_checkpoint(path)
    try:
        cfg = TrainConfig.from_dict(state["config"], source=f"{path} (its saved config)")
    except ConfigError as exc:
        raise ExportCliError(str(exc)) from None
    target_dir = target or cfg.resolve(cfg.model.target_dir)
    if not (target_dir / "config.json").is_file():
        raise ExportCliError(
            f"{target_dir}: no config.json (the checkpoint's model.target_dir); pass --target DIR"
        )
    hf = assets.target_hf_config(target_dir)
    drafter = DFlashDrafter(assets.drafter_config(cfg, hf, assets.layer_ids_for(cfg, hf)))
    try:
        drafter.load_state_dict(state["drafter"], strict=True)
    except RuntimeError as exc:
        first = str(exc).strip().splitlines()[0]
        raise ExportCliError(f"{path}: its drafter does not fit {target_dir}: {first}") from None
    fp32, bf16 = export_forms(drafter, out)
    return int(state["step"]), fp32, bf16


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_arguments(args)
        path = resolve_checkpoint(args.checkpoint, args.run_dir)
        step, fp32, bf16 = export_checkpoint(path, args.out, args.target)
    except TrainerError as exc:  # CheckpointError, UserError, ExportCliError: one line
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    except KeyboardInterrupt:
        print("interrupted: an export directory without config.json is incomplete", file=sys.stderr)
        return ExitCode.INTERRUPTED
    print(f"Exported step {step} ({path}) to {fp32} (bf16: {bf16})")
    return ExitCode.OK


if __name__ == "__main__":
    raise SystemExit(main())
