"""D-PACE and logit-distillation step time against the decayed CE, side by side in one run.

    .venv/bin/python benchmarks/bench_losses.py [--steps 120] [--rounds 3] [--vocab V]

The real drafter step of the tiny CPU config (configs/tiny-cpu.toml; `train_step`: anchors,
forward+backward in the bounded step, the step's reduce, clip, AdamW): one drafter per
`[model.loss]`, all from the same seed, each fed the same packets (captured once from the tiny
target, with the last hidden state for the distilling ones, as the target workers ship them).
The losses take turns packet by packet, their order rotated every packet, so load from other
work and drift hit them alike; ratios are of each loss's total time over CE's, per round
(median and range over the rounds). Also the target's capture per batch without and with the
last hidden state (what distillation adds upstream: every layer and the final norm run).
`--vocab` widens the tiny target's vocabulary (64 in the config): distillation costs one more
full-vocabulary projection per scored slot, so its overhead grows with V. One CPU thread.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
import tomllib
from collections import deque
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from trainer.config import TrainConfig  # noqa: E402
from trainer.config.overlay import TomlTable, merge  # noqa: E402
from trainer.model.target import TargetModel  # noqa: E402
from trainer.pipeline.build import Parts, build_parts  # noqa: E402
from trainer.pipeline.collate import HostBatch, collate_batch  # noqa: E402
from trainer.pipeline.distributed import World  # noqa: E402
from trainer.pipeline.evals import quiet_hf  # noqa: E402
from trainer.pipeline.faults import FaultPlan  # noqa: E402
from trainer.pipeline.reduce import StepFlags  # noqa: E402
from trainer.pipeline.stages import Packet  # noqa: E402
from trainer.pipeline.step import train_step  # noqa: E402

LOSSES: dict[str, TomlTable] = {
    "ce": {},
    "dpace": {"type": "dpace"},
    "ce+kd(0.5)": {"kd_weight": 0.5},
    "dpace+kd(1)": {"type": "dpace", "kd_weight": 1.0},
}


class Feed:
    """train_step's packet source: this loss's next packet."""

    def __init__(self) -> None:
        self.packets: deque[tuple[int, Packet]] = deque()

    def get(self) -> tuple[int, Packet]:
        return self.packets.popleft()

    def depth(self) -> int:
        return 0


def _config(root: Path, vocab: int | None) -> TomlTable:
    raw = tomllib.loads((REPO / "configs" / "tiny-cpu.toml").read_text())
    over: TomlTable = {
        "data": {"store": str(root / "store")},
        "model": {"target_dir": str(root / "target")},
    }
    if vocab is not None:  # a wider head; the mask token stays the top row
        over["model"] = {**over["model"], "mask_token_id": vocab - 1}
        over["model"]["tiny_target"] = {**raw["model"]["tiny_target"], "vocab_size": vocab}
    return merge(raw, over)


def _packet(host: HostBatch, hidden: torch.Tensor) -> Packet:
    return Packet(
        host.input_ids,
        host.loss_mask,
        host.attention_mask,
        hidden,
        host.real_tokens,
        host.position_ids,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=120, help="packets (steps) per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--vocab", type=int, default=None, help="tiny target vocabulary (64)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    quiet_hf()  # no progress bars between the figures
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        raw = _config(root, args.vocab)
        parts: dict[str, Parts] = {}
        for name, loss in LOSSES.items():
            cfg = TrainConfig.from_dict(merge(raw, {"model": {"loss": loss}}))
            parts[name] = build_parts(cfg, World(), root / name, FaultPlan())
        p0 = parts["ce"]
        target = TargetModel.load(p0.target_dir, p0.layer_ids, "cpu", p0.target_dtype)
        width = p0.dcfg.num_features * p0.dcfg.hidden_size
        hosts = [collate_batch(p0.store, s, p0.plan.batch(s), False) for s in range(args.steps)]
        plain_s, final_s, captured = [], [], []
        for host in hosts:
            ids, attn, pos = host.input_ids, host.attention_mask, host.position_ids
            t0 = time.perf_counter()
            target.capture(ids, attn, position_ids=pos)
            t1 = time.perf_counter()
            both = target.capture(ids, attn, position_ids=pos, final=True)
            t2 = time.perf_counter()
            plain_s.append(t1 - t0)
            final_s.append(t2 - t1)
            captured.append(both)
        print(
            f"tiny-cpu config, vocab {target.vocab_size}, hidden {target.hidden_size}, "
            f"block {p0.dcfg.block_size}, {p0.cfg.model.num_anchors} anchors/row, "
            f"{args.steps} steps x {args.rounds} rounds, 1 thread"
        )
        cap = statistics.median(plain_s) * 1e3
        cap_final = statistics.median(final_s) * 1e3
        print(
            f"target capture per batch: {cap:.2f} ms, with the last hidden state "
            f"{cap_final:.2f} ms ({cap_final / cap:.3f}x)"
        )
        names = list(LOSSES)
        feeds = {n: Feed() for n in names}
        totals: dict[str, list[float]] = {n: [] for n in names}
        steps: dict[str, list[float]] = {n: [] for n in names}
        step = 0
        for _ in range(args.rounds):
            spent = dict.fromkeys(names, 0.0)
            for i, (host, both) in enumerate(zip(hosts, captured, strict=True)):
                order = names[i % len(names) :] + names[: i % len(names)]
                for n in order:
                    p = parts[n]
                    hidden = both if p.cfg.model.loss.distills else both[..., :width].contiguous()
                    feeds[n].packets.append((i, _packet(host, hidden)))
                    t0 = time.perf_counter()
                    train_step(p, feeds[n], step, StepFlags, contextlib.nullcontext())
                    dt = time.perf_counter() - t0
                    spent[n] += dt
                    steps[n].append(dt)
                step += 1
            for n in names:
                totals[n].append(spent[n])
        print(f"{'loss':<14} {'median step ms':>14} {'total / ce (median [range] of rounds)':>40}")
        for n in names:
            ratios = [a / b for a, b in zip(totals[n], totals["ce"], strict=True)]
            med = statistics.median(steps[n]) * 1e3
            print(
                f"{n:<14} {med:>14.2f} {statistics.median(ratios):>21.3f} "
                f"[{min(ratios):.3f}-{max(ratios):.3f}]"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
