"""In-training held-out evaluation: loss, accuracy, simulated tau and per-position acceptance.

The held-out rows (``[eval] holdout_rows``, `trainer.sampler.holdout_rows`) never train. Their
target features are captured once at setup (the target is frozen and the rows fixed) and kept
on the host; an evaluation is then drafter forwards only, on the drafter's device, under
``torch.no_grad`` and with no generator: it draws no random numbers, so a run's training
losses are the same with evaluation on or off.

Every block the training objective could draw is scored (an anchor at each supervised position
whose next token is supervised), in pieces of at most the training packet's query rows, through
the same fused LM-head CE as training (no [rows x vocab] logits):

- ``loss``/``acc``: the training loss (slot weights exp(-(k-1)/gamma)) and argmax accuracy.
- ``acc_at[k-1]`` (acc@k, k = 1..B-1): the share of blocks whose first k drafted tokens all match,
  among blocks with a k-th label; ``tau_exp = 1 + sum(acc@k)``, the tau those shares imply.
- ``tau``: the serving walk (`trainer.model.fit.walk_accept_lengths`: start at the first
  generated token, jump by accepted + 1, bonus counted, max = B) over each supervised span's
  teacher-forced streaks, generating the span's length less B-1 tokens (so no drafted block is
  cut short by the end of the data); the mean of per-span means, as ``trainer.eval`` averages
  turns. With labels that are the target's greedy text this equals real speculative tau
  (tested against `speculative_generate`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from trainer.config import EvalConfig
from trainer.data.store import TokenStore
from trainer.events import TOKENS_KEY, EvalEvent
from trainer.kernels import lm_head_cross_entropy
from trainer.kernels.common import Backend
from trainer.model.attention import build_mask
from trainer.model.drafter import DFlashDrafter, default_gamma
from trainer.model.fit import walk_accept_lengths
from trainer.model.losses import slot_weights
from trainer.model.masks import Anchors
from trainer.model.objective import block_labels, streaks
from trainer.model.split_step import split_pieces
from trainer.model.target import TargetModel
from trainer.pipeline.collate import collate
from trainer.sampler import greedy_batch_sizes


@dataclass
class HeldOutBatch:
    """Right-padded held-out rows and their captured target features (host memory)."""

    input_ids: Tensor  # [R, S] int64
    loss_mask: Tensor  # [R, S] uint8
    attention_mask: Tensor  # [R, S] int64
    hidden: Tensor  # [R, S, F*H] target dtype


@dataclass(frozen=True)
class EvalResult:
    """One evaluation's figures (None where no block or span could be scored)."""

    tau: float | None
    loss: float | None
    acc: float | None
    acc_at: list[float]
    tau_exp: float | None
    rows: int
    blocks: int
    spans: int
    seconds: float
    tau_real: float | None = None  # real greedy speculative tau on [eval] prompts
    greedy_match: tuple[int, int] | None = None  # (prompts equal to greedy decoding, prompts)


def pack_rows(lengths: np.ndarray, token_budget: int, max_batch: int) -> list[np.ndarray]:
    """Positions into `lengths`, length-sorted and cut by the sampler's greedy packer."""
    order = np.argsort(lengths, kind="stable")
    sizes = greedy_batch_sizes(
        lengths[order], np.zeros(len(order), np.int64), token_budget, max_batch
    )
    return np.split(order, np.cumsum(sizes)[:-1]) if len(order) else []


@torch.no_grad()
def capture_held_out(
    store: TokenStore,
    rows: np.ndarray,
    target: TargetModel,
    *,
    token_budget: int,
    max_batch: int,
) -> list[HeldOutBatch]:
    """Collate `rows` into budget-sized batches and capture their features once (kept on host)."""
    lengths = np.asarray(store.lengths, dtype=np.int64)[rows]
    device = target.device
    out = []
    for part in pack_rows(lengths, token_budget, max_batch):
        host = collate(store, 0, rows[part], pin=False)
        hidden = target.capture(host.input_ids.to(device), host.attention_mask.to(device))
        out.append(HeldOutBatch(host.input_ids, host.loss_mask, host.attention_mask, hidden.cpu()))
    return out


def eligible_anchors(loss_mask: Tensor, attention_mask: Tensor) -> Anchors:
    """Every position the objective may anchor at: supervised, next token supervised (sorted)."""
    sup = loss_mask.bool() & attention_mask.bool()
    ok = torch.zeros_like(sup)
    ok[:, :-1] = sup[:, :-1] & sup[:, 1:]
    width = max(1, int(ok.sum(1).max()))
    # Stable sort puts each row's eligible positions first, in order; padding keeps keep=False.
    order = torch.sort((~ok).to(torch.int8), dim=1, stable=True).indices[:, :width]
    return Anchors(order, ok.gather(1, order))


def supervised_spans(loss_mask: Tensor, attention_mask: Tensor) -> list[list[tuple[int, int]]]:
    """Per row, the [start, end) runs of supervised real positions (the generated turns)."""
    sup = (loss_mask.bool() & attention_mask.bool()).cpu().numpy()
    out = []
    for row in sup:
        edges = np.flatnonzero(np.diff(np.concatenate(([0], row.astype(np.int8), [0]))))
        out.append([(int(s), int(e)) for s, e in zip(edges[::2], edges[1::2], strict=True)])
    return out


@dataclass
class _Sums:
    loss: float = 0.0
    weight: float = 0.0
    correct: int = 0
    pred: int = 0
    blocks: int = 0


@torch.no_grad()
def evaluate(
    drafter: DFlashDrafter,
    batches: Sequence[HeldOutBatch],
    *,
    gamma: float | None,
    max_query_rows: int | None,
    autocast: contextlib.AbstractContextManager[object] | None = None,
    attn_backend: str = "auto",
    ce_backend: Backend = "auto",
) -> EvalResult:
    """Score the held-out batches with the drafter as it is now (no RNG, no gradients)."""
    t0 = time.monotonic()
    bsz = drafter.config.block_size
    gamma = default_gamma(bsz) if gamma is None else float(gamma)
    head = drafter.lm_head.weight
    device = head.device
    was_training = drafter.training
    drafter.eval()
    sums = _Sums()
    at_num = torch.zeros(bsz - 1, dtype=torch.int64)
    at_den = torch.zeros(bsz - 1, dtype=torch.int64)
    span_taus: list[float] = []
    rows = 0
    try:
        for b in batches:
            ids, lm, attn = (t.to(device) for t in (b.input_ids, b.loss_mask, b.attention_mask))
            hidden = b.hidden.to(device)
            streak_at = _streaks_at(
                drafter, ids, lm, attn, hidden, gamma, max_query_rows, autocast,
                attn_backend, ce_backend, sums, at_num, at_den,
            )  # fmt: skip
            rows += ids.shape[0]
            for r, spans in enumerate(supervised_spans(lm, attn)):
                for s, e in spans:
                    # Stop B-1 tokens before the span ends, so every drafted block has all its
                    # labels: a block cut by the data's end would undercount (serving never is).
                    steps = walk_accept_lengths(streak_at[r], s, e - s - (bsz - 1))
                    if steps:
                        span_taus.append(sum(steps) / len(steps))
    finally:
        drafter.train(was_training)
    acc_at = [
        float(n) / float(d) if d else 0.0
        for n, d in zip(at_num.tolist(), at_den.tolist(), strict=True)
    ]
    return EvalResult(
        tau=sum(span_taus) / len(span_taus) if span_taus else None,
        loss=sums.loss / sums.weight if sums.weight > 0 else None,
        acc=sums.correct / sums.pred if sums.pred else None,
        acc_at=acc_at,
        tau_exp=1.0 + sum(acc_at) if sums.blocks else None,
        rows=rows,
        blocks=sums.blocks,
        spans=len(span_taus),
        seconds=time.monotonic() - t0,
    )


def _streaks_at(
    drafter: DFlashDrafter,
    ids: Tensor,
    lm: Tensor,
    attn: Tensor,
    hidden: Tensor,
    gamma: float,
    max_query_rows: int | None,
    autocast: contextlib.AbstractContextManager[object] | None,
    attn_backend: str,
    ce_backend: Backend,
    sums: _Sums,
    at_num: Tensor,
    at_den: Tensor,
) -> Tensor:
    """Teacher-forced streak of the block anchored at every eligible position: int64 [R, S] on
    the host (0 elsewhere), adding the batch's loss/acc/acc@k counts to the running sums."""
    bsz = drafter.config.block_size
    head = drafter.lm_head.weight
    device = ids.device
    anchors = eligible_anchors(lm, attn)
    out = torch.zeros(ids.shape, dtype=torch.int64)
    if not bool(anchors.keep.any()):
        return out
    k = torch.arange(1, bsz)
    for rows, cols in split_pieces(anchors, bsz, max_query_rows):
        part = Anchors(anchors.positions[rows, cols], anchors.keep[rows, cols])
        positions = part.positions.to(device)
        block_ids = drafter.block_input_ids(ids[rows].gather(1, positions))
        block_pos = (positions[:, :, None] + torch.arange(bsz, device=device)).flatten(1)
        mask = build_mask(positions, attn[rows], bsz, attn_backend)
        with autocast if autocast is not None else contextlib.nullcontext():
            hid = drafter(hidden[rows], block_ids, block_pos, mask)
        hid = hid.view(*positions.shape, bsz, -1)[:, :, 1:]
        labels, valid = block_labels(ids[rows], lm[rows], attn[rows], part, bsz)
        ce = lm_head_cross_entropy(
            hid[valid].to(head.dtype), head, labels[valid], backend=ce_backend
        )
        correct = torch.zeros_like(valid)
        correct[valid] = ce.correct
        streak = streaks(correct, valid).cpu()  # [r, n]
        w = slot_weights(bsz, gamma, device).expand_as(valid)[valid]
        sums.loss += float((ce.loss * w).sum())
        sums.weight += float(w.sum())
        sums.correct += int(ce.correct.sum())
        sums.pred += int(valid.sum())
        keep = part.keep
        sums.blocks += int(keep.sum())
        valid_h = valid.cpu()
        at_den += valid_h.sum((0, 1))
        at_num += (valid_h & (streak[:, :, None] >= k)).sum((0, 1))
        r_idx = torch.arange(rows.start, rows.stop)[:, None].expand_as(part.positions)
        out[r_idx[keep], part.positions[keep]] = streak[keep]
    return out


@dataclass
class Best:
    """(step, held-out tau) of the best checkpoint so far; one holder shared by the evaluator,
    which compares against it, and the checkpointer, which saves it (`state_dict`)."""

    value: tuple[int, float] | None = None

    def state_dict(self, holdout_rows: int) -> dict[str, object]:
        return {"holdout_rows": holdout_rows, "best": self.value}

    def load_state_dict(
        self, state: dict[str, object] | None, exists: Callable[[int], bool]
    ) -> None:
        """The saved best, kept only while its checkpoint file `exists`."""
        best = (state or {}).get("best")
        if isinstance(best, tuple | list) and exists(int(best[0])):
            self.value = (int(best[0]), float(best[1]))


class InTraining:
    """The runner's side of evaluation: when it is due, the best so far, the Eval line.

    Only the main rank holds the held-out batches (`batches` None elsewhere); every rank keeps
    the same schedule, so the ranks agree on when an evaluation (and a new best's checkpoint)
    happens. `best` is (step, tau) of the best checkpoint: the highest tau, ties to the later
    step, and only evaluations at steps > 0 (step 0 has no checkpoint) can become it.
    """

    def __init__(
        self,
        cfg: EvalConfig,
        batches: list[HeldOutBatch] | None,
        *,
        gamma: float | None,
        max_query_rows: int | None,
        best: Best,
        real: Callable[[DFlashDrafter], tuple[float, int, int]] | None = None,
    ) -> None:
        self.cfg, self.batches, self.real = cfg, batches, real
        self.gamma, self.max_query_rows = gamma, max_query_rows
        self.best = best
        self.every_s = (cfg.every_minutes or math.inf) * 60
        self.started = self.last_t = time.monotonic()
        self.spent = 0.0  # seconds evaluating since `started`

    def start(self) -> None:
        """The drafter loop starts: wall time (and the eval's share of it) counts from here."""
        self.started = self.last_t = time.monotonic()
        self.spent = 0.0

    def time_due(self) -> bool:
        return time.monotonic() - self.last_t >= self.every_s

    def due(self, step: int, time_flag: bool, final: bool) -> bool:
        every = self.cfg.every_steps
        return final or time_flag or bool(every and step % every == 0)

    def run(
        self, drafter: DFlashDrafter, autocast: contextlib.AbstractContextManager[object] | None
    ) -> EvalResult | None:
        """Evaluate now (None on ranks without the held-out batches)."""
        if self.batches is None:
            return None
        res = evaluate(
            drafter,
            self.batches,
            gamma=self.gamma,
            max_query_rows=self.max_query_rows,
            autocast=autocast,
        )
        if self.real is not None:
            t0 = time.monotonic()
            was_training = drafter.training
            drafter.eval()
            try:
                tau, same, n = self.real(drafter)
            finally:
                drafter.train(was_training)
            res = dataclasses.replace(
                res,
                tau_real=tau,
                greedy_match=(same, n),
                seconds=res.seconds + time.monotonic() - t0,
            )
        self.spent += res.seconds
        self.last_t = time.monotonic()
        return res

    def better(self, step: int, res: EvalResult | None) -> bool:
        """Would `res` at `step` be the new best (ties go to the later step)?"""
        if step <= 0 or res is None or res.tau is None:
            return False
        return self.best.value is None or res.tau >= self.best.value[1]

    def share(self) -> float | None:
        """Evaluation's share of the drafter loop's wall time so far (None before any)."""
        wall = time.monotonic() - self.started
        return self.spent / wall if wall > 0 and self.spent > 0 else None

    def event(self, step: int, res: EvalResult, tokens: int | None = None) -> EvalEvent:
        """The Eval line's event; `tokens` (real tokens trained by `step`, all ranks) becomes
        its `tokens=` extra, as on status lines."""
        extra = {"rows": str(res.rows), "blocks": str(res.blocks), "eval_s": f"{res.seconds:.2f}"}
        if tokens is not None:
            extra[TOKENS_KEY] = str(tokens)
        if res.greedy_match is not None:
            extra["greedy_match"] = f"{res.greedy_match[0]}/{res.greedy_match[1]}"
        share = self.share()
        if step > 0 and share is not None:
            extra["cost"] = f"{100 * share:.1f}%"
        return EvalEvent(
            step=step,
            tau=res.tau,
            tau_real=res.tau_real,
            loss=res.loss,
            acc=res.acc,
            acc_at=res.acc_at,
            tau_exp=res.tau_exp,
            best=self.best.value[0] if self.best.value else None,
            extra=extra,
        )
