"""`python -m trainer.memory --config RUN.toml [--device-memory 96GiB] [--json]`.

Exit 0: every device fits with the configured `model.max_query_rows`; 1: some device does not
(the text names the key and the largest value that fits); 2: a usage error (one line naming
the file and key). Needs no GPU and imports no torch.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from trainer.errors import ExitCode
from trainer.memory.shapes import MemoryEstimateError

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40})


def parse_bytes(text: str, key: str, *, zero_ok: bool = False) -> int:
    """'96GB' (10^9), '139GiB' (2^30), '512MiB', or plain bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise MemoryEstimateError(f"{key}: {text!r} is not a size like 96GB, 139GiB or 512MiB")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 0 or (value == 0 and not zero_ok):
        raise MemoryEstimateError(f"{key}: {text!r} must be positive")
    return value


def gib(n: int | float) -> str:
    """Bytes in GiB, or MiB/KiB below one GiB (tiny test runs stay readable)."""
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size or unit == "KiB":
            return f"{n / size:,.2f} {unit}"
    raise AssertionError("unreachable")


def _text(rep: dict, config: Path) -> str:  # type: ignore[type-arg]
    d = rep["drafter"]
    lines = [
        f"memory estimate for {config} on {gib(rep['device_memory'])} per device "
        f"(reserve {gib(rep['reserve'])} for CUDA itself; available {gib(rep['available'])})",
        f"  batches: {rep['batches']} over {rep['epochs_scanned']} epoch(s), "
        f"{rep['distinct_batch_shapes']} distinct shapes"
        + (f", packed rows of {rep['row_length']} tokens" if rep["row_length"] else "")
        + f"; lengths: {rep['lengths_source']}",
        f"  drafter: {d['params'] / 1e9:.3f} B params; activations {d['per_query_row_bytes'] / 2**20:.3f} "
        f"MiB per query row ({rep['precision']['attention']}, compute {rep['precision']['compute_bytes']} B)",
    ]
    for dev in rep["devices"]:
        verdict = "fits" if dev["fits"] else "DOES NOT FIT"
        lines.append(
            f"  {dev['device']} ({'+'.join(dev['roles'])}): peak {gib(dev['peak'])} {verdict}"
        )
        for k, v in dev["items"].items():
            lines.append(f"      {k:<32} {gib(v):>14}")
    names = ("configured", "unbounded") if d["configured"]["max_query_rows"] else ("unbounded",)
    for name in names:
        p = d[name]
        wb, wp = p["worst_batch"], p["worst_piece"]
        lines.append(
            f"  max_query_rows={p['max_query_rows']}: drafter peak {gib(p['peak'])}"
            f" ({'fits' if p['fits'] else 'does not fit'}); worst batch {wb['rows']} x "
            f"{wb['seq']} ({wb['anchors_per_row_max']} anchors, {wb['query_rows']:,} query rows), "
            f"worst micro-step {wp['rows']} x {wp['seq']} x {wp['anchors']} anchors "
            f"({wp['query_rows']:,} query rows, activations {gib(p['activations'])})"
        )
    largest = d["largest_max_query_rows"]
    if largest is None:
        lines.append(
            f"  no {rep['key']} fits: the fixed costs and staged packets alone exceed the device"
        )
    else:
        lines.append(f"  largest {rep['key']} that fits: {largest:,}")
    if not rep["fits"]:
        lines.append(
            f"  does not fit: set {rep['key']} = {largest} (or lower)"
            if largest
            else "  does not fit at any budget"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m trainer.memory", description=__doc__)
    ap.add_argument("--config", required=True, type=Path, help="run config (TOML)")
    ap.add_argument("--device-memory", default="96GB", help="memory per device (default 96GB)")
    ap.add_argument("--reserve", default="1.5GiB", help="taken by CUDA itself (default 1.5GiB)")
    ap.add_argument(
        "--target-config",
        type=Path,
        help="the target's config.json (default: model.target_dir/config.json)",
    )
    ap.add_argument("--json", action="store_true", help="print the report as JSON")
    args = ap.parse_args(argv)
    try:
        rep = run(
            args.config,
            parse_bytes(args.device_memory, "--device-memory"),
            parse_bytes(args.reserve, "--reserve", zero_ok=True),
            args.target_config,
        )
    except MemoryEstimateError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return ExitCode.USAGE
    print(json.dumps(rep, indent=2) if args.json else _text(rep, args.config))
    return ExitCode.OK if rep["fits"] else ExitCode.FAILED


def run(config: Path, device_memory: int, reserve: int, target_config: Path | None) -> dict:  # type: ignore[type-arg]
    from trainer.config import ConfigError, TrainConfig
    from trainer.memory.batches import batch_shapes
    from trainer.memory.estimate import Estimator, precision_for, report
    from trainer.memory.shapes import drafter_shape, read_target_shape

    if not config.is_file():
        raise MemoryEstimateError(f"{config}: no such config file")
    try:
        cfg = TrainConfig.load(config)
    except ConfigError as exc:
        raise MemoryEstimateError(str(exc).splitlines()[0]) from None
    target = read_target_shape(target_config or cfg.resolve(cfg.model.target_dir))
    est = Estimator(cfg, target, drafter_shape(cfg, target), batch_shapes(cfg), precision_for(cfg))
    return report(est, device_memory, reserve)
