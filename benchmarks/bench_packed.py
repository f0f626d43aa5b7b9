"""Where a packed batch's extra cost goes: target capture vs drafter step, per strategy (CPU).

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_packed.py [--config configs/tiny-cpu.toml]
        [--batches 40] [--rounds 3] [--strategies sorted,packed,packed:rows] [--set K=V ...]

The trainer's own parts (`build_parts`: sampler, plan, drafter) and target (`TargetModel.load`)
on the config; `--batches` micro-batches spread evenly over epoch 0 of each strategy's plan,
collated as the prefetch workers do; `target.capture` and `bounded_objective_backward` timed
separately in CPU seconds of this process (`time.process_time`, one torch thread), strategies
interleaved within each round, the median round kept. Prints, per strategy and stage,
microseconds per real token, and the first strategy's cost over each one's (the ratio of
tokens per CPU-second, as `trainer.measure --clock cpu` reports it for the whole trainer).
`packed:rows` runs the drafter on the packed rows themselves (`unpack=False`); `packed` runs it
as the trainer does on CPU (each document unpacked into a row of its own). `packed:mask` captures
through transformers' block-diagonal mask (`TargetModel.document_attention = False`) instead of
the grouped per-document attention (`trainer.model.target_attention`, on for CPU targets);
`packed:gN` caps its document groups at N (`--max-groups N` for every strategy); suffixes
combine (`packed:rows:mask`); `packed@N` packs rows of N tokens (`packed@1024:mask`).
`--capture-only` skips the drafter.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import tomllib
from pathlib import Path

import torch

from trainer.config import TrainConfig
from trainer.config.overlay import merge
from trainer.measure.cli import overrides
from trainer.measure.drive import variant
from trainer.model.split_step import bounded_objective_backward
from trainer.model.target import TargetModel
from trainer.pipeline import build
from trainer.pipeline.collate import HostBatch, collate_batch
from trainer.pipeline.distributed import World
from trainer.pipeline.faults import FaultPlan

REPO = Path(__file__).resolve().parents[1]


def _batches(cfg: TrainConfig, n: int, run_dir: Path) -> tuple[build.Parts, list[HostBatch]]:
    parts = build.build_parts(cfg, World(), run_dir, FaultPlan())
    per_epoch = len(parts.sampler.epoch_batches(0))
    picks = sorted({round(i * (per_epoch - 1) / max(1, n - 1)) for i in range(n)})
    hosts = [collate_batch(parts.store, s, parts.plan.batch(s), False) for s in picks]
    return parts, hosts


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=REPO / "configs" / "tiny-cpu.toml")
    ap.add_argument("--batches", type=int, default=40)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--strategies",
        default="sorted,packed,packed:rows",
        help="packed:rows = the drafter on the packed rows (unpack=False); "
        "packed:mask = capture through transformers' mask (no grouped document attention)",
    )
    ap.add_argument(
        "--capture-only", action="store_true", help="time target.capture alone (no drafter)"
    )
    ap.add_argument("--max-groups", type=int, default=None, help="document groups per capture")
    ap.add_argument("--set", action="append", default=[], dest="sets")
    args = ap.parse_args()
    torch.set_num_threads(1)
    raw0 = tomllib.loads(args.config.read_text())
    over = overrides(args.sets)
    tmp = Path(tempfile.mkdtemp(prefix="bench-packed-"))
    runs = {}
    for name in args.strategies.split(","):
        strategy, keys = variant(name.split(":")[0])  # packed@N: rows of N tokens
        raw = merge(merge(raw0, over), {"batching": {"strategy": strategy, **keys}})
        cfg = TrainConfig.from_dict(raw)
        cfg._source = args.config.resolve()
        parts, hosts = _batches(cfg, args.batches, tmp / name)
        target = TargetModel.load(parts.target_dir, parts.layer_ids, "cpu")
        flags = name.split(":")[1:]
        if "mask" in flags:
            target.document_attention = False
        groups = [int(f[1:]) for f in flags if f[:1] == "g" and f[1:].isdigit()]
        if groups or args.max_groups is not None:
            target.document_groups = groups[0] if groups else args.max_groups
        runs[name] = (parts, hosts, target)
    times: dict[str, dict[str, list[float]]] = {n: {"capture": [], "drafter": []} for n in runs}
    for r in range(args.rounds):
        for name, (parts, hosts, target) in runs.items():
            m = parts.cfg.model
            gen = torch.Generator().manual_seed(r)
            cap = dr = 0.0
            for h in hosts:
                t0 = time.process_time()
                hidden = target.capture(h.input_ids, h.attention_mask, position_ids=h.position_ids)
                t1 = time.process_time()
                if args.capture_only:
                    cap += t1 - t0
                    continue
                bounded_objective_backward(
                    parts.drafter,
                    h.input_ids,
                    h.loss_mask,
                    h.attention_mask,
                    hidden,
                    max_query_rows=m.max_query_rows,
                    num_anchors=m.num_anchors,
                    gamma=m.gamma,
                    noise=m.noise,
                    generator=gen,
                    position_ids=h.position_ids,
                    unpack="rows" not in name.split(":")[1:],
                )
                t2 = time.process_time()
                parts.drafter.zero_grad(set_to_none=True)
                cap += t1 - t0
                dr += t2 - t1
            times[name]["capture"].append(cap)
            times[name]["drafter"].append(dr)
    spread = {n: (min(t["capture"]), max(t["capture"])) for n, t in times.items()}
    base = None
    print(
        f"{'strategy':10} {'tokens':>7} {'rows':>5} {'width':>5} | "
        f"{'capture us/tok':>14} {'drafter us/tok':>14} {'total us/tok':>12} | vs first"
    )
    for name, (_parts, hosts, _) in runs.items():
        tok = sum(h.real_tokens for h in hosts)
        rows = sum(h.input_ids.shape[0] for h in hosts) / len(hosts)
        width = sum(h.input_ids.shape[1] for h in hosts) / len(hosts)
        c = statistics.median(times[name]["capture"]) / tok * 1e6
        d = statistics.median(times[name]["drafter"]) / tok * 1e6
        base = base or (c, d, c + d)
        print(
            f"{name:10} {tok:7d} {rows:5.1f} {width:5.0f} | {c:14.2f} {d:14.2f} {c + d:12.2f} |"
            f" cap {base[0] / c:.2f} dr {_ratio(base[1], d)} all {base[2] / (c + d):.2f}"
            f" | capture rounds {spread[name][0] / tok * 1e6:.2f}-{spread[name][1] / tok * 1e6:.2f}"
        )


def _ratio(first: float, this: float) -> str:
    return f"{first / this:.2f}" if this > 0 else "-"


if __name__ == "__main__":
    main()
