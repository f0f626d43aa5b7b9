"""The packed strategy's row length under the time objective: the candidate whose epoch the
step-cost model predicts fastest.

Every candidate packs the same documents, so anchor blocks and samples per epoch do not move
with the row length; what does is the number of micro-batches (`batches`: a fixed cost each),
the slots a batch pads (`padded_tokens`) and the attention term (`padded_sq`). Longer rows fill
the budget better (a row of T tokens leaves at most one tail per batch) and give fewer, fuller
micro-batches; when the target attends over whole rows (transformers' block-diagonal mask, a
calibration without `document_attention`) their attention grows with the row length squared,
which the model prices and the choice then weighs. Candidates: the longest sample and every
T // k at least as long (k rows fill a batch's budget). Each candidate is the sampler's own
epoch 0 (`BatchSampler`, strategy packed), so the prediction is the trainer's batches, not an
estimate of them. numpy only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

from trainer.bucketing.timecost import StepCostModel, batch_features
from trainer.sampler import BatchSampler

MAX_CANDIDATES = 12  # row lengths tried (the longest sample, then T // k for the smallest k)


@dataclass(frozen=True)
class RowLengthOption:
    """One candidate row length's epoch 0, as the sampler batches it, and its predicted rate."""

    row_length: int
    batches: int  # micro-batches per epoch
    row_fill: float  # real tokens / (rows x row_length)
    padding_efficiency: float  # real tokens / padded slots (rows pad to their batch's fullest)
    predicted_s: float  # predicted seconds of the epoch
    samples_s: float
    tokens_s: float

    def to_json_dict(self) -> dict[str, float | int]:
        return asdict(self)


def row_length_candidates(longest: int, token_budget: int) -> list[int]:
    """Ascending: `longest` and each token_budget // k >= longest (at most `MAX_CANDIDATES`,
    the longest rows first kept)."""
    out = {longest}
    for k in range(1, token_budget // max(1, longest) + 1):
        out.add(token_budget // k)
        if len(out) >= MAX_CANDIDATES:
            break
    return sorted(r for r in out if longest <= r <= token_budget)


def row_length_options(
    lengths: np.ndarray,
    *,
    token_budget: int,
    max_batch: int,
    model: StepCostModel,
    seed: int = 0,
) -> list[RowLengthOption]:
    """Each candidate row length's epoch 0 with its predicted time under `model`.

    Anchor blocks are the calibration's blocks per sample (the planner sees only lengths; they
    do not move with the row length). The attention term is per document when the calibration
    says its target attended per document (`meta["document_attention"]`)."""
    x = np.asarray(lengths, dtype=np.int64)
    per_document = bool(model.meta.get("document_attention", False))
    docs = x if per_document else None
    no_anchors = np.zeros(len(x), dtype=np.int64)
    out = []
    for row_length in row_length_candidates(int(x.max()), token_budget):
        sampler = BatchSampler(
            x,
            strategy="packed",
            token_budget=token_budget,
            max_batch=max_batch,
            seed=seed,
            row_length=row_length,
        )
        batches = sampler.epoch_batches(0)
        feats = np.stack([batch_features(b, no_anchors, 0, docs) for b in batches])
        feats[:, 2] = model.anchor_blocks_per_sample * feats[:, 3]
        seconds = float(model.predict(feats).sum())
        real = sum(b.real_tokens for b in batches)
        samples = sum(len(b.indices) for b in batches)
        n_rows = sum(b.num_rows for b in batches)
        slots = sum(b.num_rows * b.max_len for b in batches)
        out.append(
            RowLengthOption(
                row_length=row_length,
                batches=len(batches),
                row_fill=real / (n_rows * row_length),
                padding_efficiency=real / slots,
                predicted_s=seconds,
                samples_s=samples / seconds if seconds > 0 else float("nan"),
                tokens_s=real / seconds if seconds > 0 else float("nan"),
            )
        )
    return out


def best_row_length(options: Sequence[RowLengthOption]) -> RowLengthOption:
    """The fastest predicted epoch (ties: the shorter row, less memory per micro-batch)."""
    return min(options, key=lambda o: (o.predicted_s, o.row_length))
