"""The gate's stages in order (`trainer.gate.cli` parses, this runs): the run's parts built as
`python -m trainer` builds them, then capture, masks, train, decode, export, engine."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from trainer.config import TrainConfig
from trainer.data.store import TokenStore
from trainer.gate.report import PASS_SHARE, GateFailure, Report
from trainer.gate.stages import Decoded, check_capture, check_masks, decode
from trainer.model.drafter import DFlashDrafter, DrafterConfig
from trainer.model.engine_fields import check_export
from trainer.model.errors import ExportError
from trainer.model.export import export_drafter, load_drafter
from trainer.model.fit import Row, evaluate_full_blocks, fit, greedy_continuations
from trainer.model.target import TargetModel
from trainer.pipeline import assets
from trainer.serving.compare import compare, own_counters, served_turn
from trainer.serving.served_eval import EngineSpec, open_session

MAX_RESPONSE = 64
PATIENCE = 5  # consecutive steps at teacher-forced accuracy 1 before the full-block check
CHUNK = 100  # steps per training round between full-block checks


def sample_rows(
    cfg: TrainConfig, target: TargetModel, first: int, count: int, response: int | None
) -> list[Row]:
    """Store rows first..first+count-1: each one's prompt, then the target's own greedy
    continuation (`response` tokens, default the row's response length, at most 64)."""
    store = TokenStore.open(assets.ensure_store(cfg))
    if first + count > len(store):
        raise assets.UserError(
            f"{cfg.resolve(cfg.data.store)}: --sample {first} --samples {count} needs "
            f"{first + count} rows, the store has {len(store)}"
        )
    rows = []
    for i in range(first, first + count):
        tokens, mask = store.row(i)
        prompt_len = max(1, int((mask == 0).argmin()) if mask.any() else len(tokens))
        prompt = torch.as_tensor(tokens[:prompt_len].astype("int64"))[None]
        n = response or min(MAX_RESPONSE, max(2, len(tokens) - prompt_len))
        rows += greedy_continuations(target, prompt, n)
    return rows


def memorise(
    drafter: DFlashDrafter,
    target: TargetModel,
    rows: list[Row],
    steps: int,
    lr: float,
    seed: int,
) -> tuple[int, float]:
    """Train until every block of the samples is right: teacher-forced accuracy 1 with an
    anchor at every position that has a full block (random anchors miss some). Rounds of at
    most CHUNK steps (each a warm restart: warmup + cosine) until then or `steps` in all;
    returns (steps taken, accuracy)."""
    done, acc, loss = 0, 0.0, float("nan")
    while done < steps:
        history = fit(
            drafter,
            target,
            rows,
            steps=min(CHUNK, steps - done),
            lr=lr,
            batch_size=len(rows),
            num_anchors=max(len(r.ids) for r in rows),
            seed=seed + done,
            stop_acc=1.0,
            patience=PATIENCE,
        )
        done += len(history)
        full = evaluate_full_blocks(drafter, target, rows)
        acc, loss = full.acc, full.loss
        if acc == 1.0:
            return done, acc
    raise GateFailure(
        "train",
        f"not memorised in {steps} steps (teacher-forced accuracy {acc:.3f} over every full "
        f"block, loss {loss:.3f}): raise --max-steps or --lr, or look at the masks",
    )


def prompt_of(row: Row) -> list[int]:
    return [t for t, m in zip(row.ids, row.loss_mask, strict=True) if not m]


def same_decoding(a: Decoded, b: Decoded) -> bool:
    return all(
        x.tokens == y.tokens and x.accept_lengths == y.accept_lengths
        for x, y in zip(a.outputs, b.outputs, strict=True)
    )


def run_gate(
    args: argparse.Namespace, out: Path, engine: EngineSpec | None, report: Report
) -> None:
    with report.stage("setup") as entry:
        cfg = TrainConfig.load(args.config)
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        target_dir = assets.ensure_target(cfg)
        hf = assets.target_hf_config(target_dir)
        dcfg: DrafterConfig = assets.drafter_config(cfg, hf, assets.layer_ids_for(cfg, hf))
        target = TargetModel.load(target_dir, dcfg.target_layer_ids, device=device)
        bsz = dcfg.block_size
        threshold = round(PASS_SHARE * bsz, 3)
        report.figures.update(block_size=bsz, threshold=threshold, out=str(out))
        rows = sample_rows(cfg, target, args.sample, args.samples, args.response_tokens)
        report.figures["response_tokens"] = [len(r.ids) - r.loss_mask.count(0) for r in rows]
        out.mkdir(parents=True, exist_ok=True)
        prompts = out / "prompts.jsonl"  # the samples' prompts as token ids: trainer.eval reads it
        prompts.write_text("".join(json.dumps({"input_ids": prompt_of(r)}) + "\n" for r in rows))
        report.figures["prompts"] = str(prompts)
        entry["detail"] = (
            f"target {target_dir}, {len(rows)} sample(s) of {report.figures['response_tokens']} "
            f"target tokens, block {bsz}"
        )

    with report.stage("capture") as entry:
        ids = torch.tensor(rows[0].ids, device=device)[None]
        worst = check_capture(target, ids)
        entry["detail"] = f"layer ids {dcfg.target_layer_ids}, max |diff| {worst:.2g}"

    drafter = assets.build_drafter(dcfg, (target.embed_tokens, target.lm_head), device, cfg.seed)
    with report.stage("masks") as entry:
        worst, anchors = check_masks(drafter, target, rows[0])
        entry["detail"] = (
            f"training = decoding forward at {anchors} anchors, max |diff| {worst:.2g}"
        )

    with report.stage("train") as entry:
        steps, acc = memorise(drafter, target, rows, args.max_steps, args.lr, cfg.seed)
        entry["detail"] = f"memorised in {steps} steps, teacher-forced accuracy {acc:.3f}"
        report.figures["train_steps"] = steps

    with report.stage("decode") as entry:
        own = decode(target, drafter, rows)
        report.figures["own_tau"] = own.tau
        entry["detail"] = f"own loop tau {own.tau:.2f} of block {bsz}"
        if own.tau < threshold:
            raise GateFailure(
                "masks",
                f"memorised under the training mask, but the decoding loop accepts only "
                f"{own.tau:.2f} tokens per step (needs >= {threshold}): training shows the "
                "drafter what decoding does not",
            )

    export = out / "export"
    with report.stage("export") as entry:
        export_drafter(drafter, export)
        try:
            check_export(export, dcfg)
        except ExportError as err:
            raise GateFailure("export", str(err)) from None
        reloaded = decode(target, load_drafter(export, target=target, device=device), rows)
        if not same_decoding(own, reloaded):
            raise GateFailure(
                "export",
                f"{export}: the reloaded export decodes differently (tau {reloaded.tau:.2f}, "
                f"in memory {own.tau:.2f})",
            )
        entry["detail"] = f"{export}: every engine key as trained; reloaded decodes the same"

    if engine is not None:
        with report.stage("engine") as entry:
            entry["detail"] = served_stage(engine, target_dir, export, target, rows, own, report)


def served_stage(
    spec: EngineSpec,
    target_dir: Path,
    export: Path,
    target: TargetModel,
    rows: list[Row],
    own: Decoded,
    report: Report,
) -> str:
    """Each sample's prompt in the engine serving the export; its acceptance must pass the
    threshold and equal the project's loop within the served evaluation's tolerance."""
    bsz = report.figures["block_size"]
    with open_session(
        spec,
        target=target_dir,
        drafter=export,
        block_size=bsz,
        dtype=str(target.dtype).removeprefix("torch."),
        max_new_tokens=max(len(r.ids) for r in rows),
        stop_ids=[],
    ) as session:
        turns = []
        for i, (row, mine) in enumerate(zip(rows, own.outputs, strict=True)):
            prompt = prompt_of(row)
            tokens, counters = session.client.measured(
                prompt, max_tokens=len(row.ids) - len(prompt), stop_ids=[]
            )
            turns.append(served_turn(i, mine.tokens, tokens, counters))
        report.figures.update(engine=f"{session.engine} {session.version}", served=session.info())
    mine_counts = [own_counters(o.accept_lengths, bsz) for o in own.outputs]
    verdict = compare("gate", mine_counts, turns)
    served_tau = verdict.served.counters.tau
    report.figures["served_tau"] = served_tau
    name = report.figures["engine"]
    if served_tau < report.figures["threshold"] or not verdict.agree:
        raise GateFailure(
            "engine",
            f"{name} accepts {served_tau:.2f} tokens per step on {export}, the project's loop "
            f"{own.tau:.2f} ({'; '.join(verdict.differences) or 'below the threshold'}): the "
            "engine does not read the export as it was trained",
        )
    return f"{name} tau {served_tau:.2f}, own {own.tau:.2f}, tokens identical"
