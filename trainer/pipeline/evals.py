"""In-training evaluation, as the run wires it: the held-out rows recorded and captured once,
the real-decoding check of `[eval] prompts`, the Eval lines and the best checkpoint."""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from trainer.data.store import TokenStore
from trainer.events import format_eval_line
from trainer.model.drafter import DFlashDrafter
from trainer.model.target import TargetModel
from trainer.pipeline import assets, checkpoint
from trainer.pipeline.build import Parts
from trainer.pipeline.evaluate import Best, EvalResult, InTraining, capture_held_out
from trainer.pipeline.status import Reporter, RunRecord
from trainer.pipeline.track import TrackerSink

RealTau = Callable[[DFlashDrafter], tuple[float, int, int]]


def write_json(path: Path, obj: object) -> None:
    """Write JSON through a temp file and a rename (a crash leaves the old file or none)."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def record_holdout(p: Parts, record: RunRecord, reporter: Reporter) -> None:
    """The held-out rows in run-state.json (count, digest) and RUN/holdout.json (the ids)."""
    from trainer.sampler_state import rows_digest

    ev = p.cfg.eval
    record(holdout_rows=len(p.holdout), holdout_sha256=rows_digest(p.holdout))
    evaluated = min(ev.max_rows, len(p.holdout)) if ev.enabled else 0
    ids = {"seed": p.cfg.seed, "rows": p.holdout.tolist(), "evaluated": evaluated}
    try:
        write_json(p.run_dir / "holdout.json", ids)
    except OSError as exc:  # the ids are a pure function of the config: training goes on
        reporter.error(f"cannot write {p.run_dir / 'holdout.json'}: {exc}")


def held_out_rows(p: Parts) -> tuple[TokenStore, np.ndarray]:
    """(store, row ids) to evaluate: `[eval] holdout_store`'s first rows, or the first
    `max_rows` held-out rows of the training store."""
    from trainer.data.store import StoreError

    ev = p.cfg.eval
    if ev.holdout_store is None:
        return p.store, p.holdout[: ev.max_rows]
    path = p.cfg.resolve(ev.holdout_store)
    try:
        store = TokenStore.open(path)
    except StoreError as exc:
        raise assets.UserError(f"eval.holdout_store: {exc}") from None
    vocab = int(assets.target_hf_config(p.target_dir).vocab_size)
    if store.manifest.vocab_size > vocab or len(store) == 0:
        what = (
            "no rows"
            if len(store) == 0
            else (f"token ids up to {store.manifest.vocab_size - 1}, the target has {vocab}")
        )
        raise assets.UserError(f"eval.holdout_store: {path}: {what}")
    return store, np.arange(min(ev.max_rows, len(store)), dtype=np.int64)


def real_tau(p: Parts, target: TargetModel) -> RealTau:
    """Real greedy speculative decoding of `[eval] prompts` (trainer.eval's own loop and
    greedy check), read and rendered now so a bad file fails before training starts."""
    from trainer.eval import default_stop_ids, load_tokenizer, target_vocab_size
    from trainer.eval import evaluate as real_evaluate
    from trainer.eval_prompts import PromptError, Renderer, read_prompt_set
    from trainer.model.errors import TargetError

    ev = p.cfg.eval
    assert ev.prompts is not None
    path = p.cfg.resolve(ev.prompts)
    try:
        pset = read_prompt_set(path)
        pset = dataclasses.replace(pset, prompts=pset.prompts[: ev.max_prompts])
        tokenizer = load_tokenizer(p.target_dir, required=pset.needs_tokenizer)
        renderer = Renderer(tokenizer, target_vocab_size(p.target_dir))
        for prompt in pset.prompts:
            renderer.first_ids(prompt, f"{path}:{prompt.line}")
        stops = default_stop_ids(tokenizer, p.target_dir)
    except (PromptError, TargetError) as exc:
        raise assets.UserError(f"eval.prompts: {exc}") from None

    def real(drafter: DFlashDrafter) -> tuple[float, int, int]:
        _, summaries = real_evaluate(
            target, drafter, [pset], renderer, max_new_tokens=ev.max_new_tokens, eos_id=stops
        )
        total = summaries[-1]
        return total.tau, total.matches, total.prompts

    return real


def quiet_hf() -> None:
    """No transformers progress bars: they would interleave with status lines."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]  # untyped in transformers


def build_evaluator(p: Parts, best: Best, record: RunRecord) -> InTraining:
    """The held-out rows' features, captured once by a target on the drafter's device
    (main rank only; the target is dropped afterwards), and the evaluation schedule."""
    cfg = p.cfg
    batches, real = None, None
    if p.world.is_main:
        quiet_hf()
        target = TargetModel.load(p.target_dir, p.layer_ids, p.drafter_device, p.target_dtype)
        store, rows = held_out_rows(p)
        batches = capture_held_out(
            store,
            rows,
            target,
            token_budget=cfg.batching.token_budget,
            max_batch=cfg.batching.max_batch,
        )
        real = real_tau(p, target) if cfg.eval.prompts is not None else None
        del target  # kept by `real` when prompts are decoded
        if p.drafter_device.type == "cuda":
            torch.cuda.empty_cache()
        record(
            eval_rows=len(rows),
            best_step=best.value[0] if best.value else None,
            best_tau=best.value[1] if best.value else None,
        )
    # An eval piece is never larger than the largest training packet can be.
    m = cfg.model
    budget = m.max_query_rows or cfg.batching.max_batch * m.num_anchors * p.dcfg.block_size
    return InTraining(cfg.eval, batches, gamma=m.gamma, max_query_rows=budget, best=best, real=real)


class EvalReports:
    """The Eval lines, their figures in run-state.json, and `checkpoints/best.pt`."""

    def __init__(
        self,
        p: Parts,
        evaluator: InTraining,
        reporter: Reporter,
        record: RunRecord,
        tracker: TrackerSink,
    ) -> None:
        self.p, self.evaluator = p, evaluator
        self.reporter, self.record, self.tracker = reporter, record, tracker
        self.last_tau: float | None = None  # the last evaluation's tau (status lines' tau=)

    def report(self, step: int, res: EvalResult | None) -> None:
        """The Eval line (main rank) and its figures in run-state.json."""
        if res is None:
            return
        ev = self.evaluator.event(step, res, self.p.plan.real_tokens_before(step * self.p.accum))
        if ev.tau is not None:
            self.last_tau = ev.tau  # status lines carry it from now on
        line = format_eval_line(ev)
        self.reporter.line(line)
        self.tracker.track(line)
        if res.greedy_match is not None and res.greedy_match[0] < res.greedy_match[1]:
            same, n = res.greedy_match
            self.reporter.error(
                f"eval.prompts: {n - same} of {n} speculative outputs differ from greedy "
                f"decoding at step {step} (a decoding bug: tau_real is not trustworthy)"
            )
        share = self.evaluator.share()
        self.record(
            last_eval=ev.model_dump(mode="json", exclude={"kind", "extra"}),
            eval_seconds=round(self.evaluator.spent, 3),
            eval_share=round(share, 4) if share is not None else None,
        )

    def mark_best(self, step: int, saved: bool, prev: tuple[int, float] | None) -> None:
        """Point `checkpoints/best.pt` at the new best's checkpoint (if it was written)."""
        best = self.evaluator.best
        if not saved:
            best.value = prev  # no checkpoint of this step: the best stays where it was
            return
        if not self.p.world.is_main or best.value is None:
            return
        try:
            link = checkpoint.set_best(self.p.run_dir, step)
        except (OSError, checkpoint.CheckpointError) as exc:
            self.reporter.error(f"cannot mark step {step} as the best checkpoint: {exc}")
            return
        self.record(best_step=step, best_tau=best.value[1], best_checkpoint=str(link.resolve()))
