"""A step-cost model: per-device step time as a linear function of measurable batch features.

    time(step) = c_pad * padded tokens + c_sq * sum of squared padded row lengths
               + c_anchor * anchor blocks + c_sample * samples + c_step * micro-batches

Padded tokens drive the target's and the drafter's matmuls (the drafter's context attention is
blocks x block size x row width, so per row it grows with the padded width too); squared row
lengths the target's attention over each padded row (a packed row's documents, when the target
attends per document: the sum of their squared lengths); anchor blocks and samples the drafter's
per-block work; the last term is the fixed cost of a micro-batch (launches, the optimizer's
share, the pipeline's hand-offs). The coefficients are fitted by non-negative least squares
(`fit_step_cost`) from `python -m trainer.measure`'s timings, saved as a calibration file (JSON),
and read by the planner's time objective (`python -m trainer.buckets plan --objective time`),
which scores a bucket by the expected predicted time of its batches (`segment_times`).

Non-negative on purpose: every feature costs time, and a negative coefficient fitted to noise or
to collinear features (samples and anchor blocks are nearly proportional on most data) would
make the DP chase it. numpy only, torch-free (the planner imports it).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from trainer.errors import TrainerError
from trainer.sampler import Batch

FEATURES: tuple[str, ...] = ("padded_tokens", "padded_sq", "anchor_blocks", "samples", "batches")
CALIBRATION_VERSION = 1


class CalibrationError(TrainerError, ValueError):
    """An unusable calibration file or fit input (one line naming the file or key)."""


@dataclass(frozen=True)
class StepCostModel:
    """Fitted seconds per unit of each feature (`FEATURES`), with the fit's quality."""

    coef: dict[str, float]
    r2: float
    points: int  # timed windows the fit used
    anchor_blocks_per_sample: float  # what the planner (lengths only) assumes per sample
    meta: dict[str, object] = field(default_factory=dict)  # config, device, T, B, ...

    def vector(self) -> np.ndarray:
        return np.array([self.coef[k] for k in FEATURES], dtype=np.float64)

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Predicted seconds of each row of a (n, len(FEATURES)) feature matrix."""
        out: np.ndarray = np.asarray(features, dtype=np.float64) @ self.vector()
        return out

    def to_json_dict(self) -> dict[str, object]:
        return {
            "version": CALIBRATION_VERSION,
            "features": list(FEATURES),
            "coef": dict(self.coef),
            "r2": self.r2,
            "points": self.points,
            "anchor_blocks_per_sample": self.anchor_blocks_per_sample,
            "meta": dict(self.meta),
        }

    def save(self, path: str | Path) -> Path:
        out = Path(path)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_json_dict(), indent=1) + "\n")
        tmp.replace(out)
        return out

    @classmethod
    def from_json_dict(
        cls, d: Mapping[str, object], source: str = "<calibration>"
    ) -> StepCostModel:
        if d.get("version") != CALIBRATION_VERSION:
            raise CalibrationError(
                f"{source}: version {d.get('version')!r} is not {CALIBRATION_VERSION}"
            )
        coef = d.get("coef")
        if not isinstance(coef, dict):
            raise CalibrationError(f"{source}: coef must be an object of {', '.join(FEATURES)}")
        values: dict[str, float] = {}
        for k in FEATURES:
            v = coef.get(k)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise CalibrationError(f"{source}: coef.{k} must be a finite number, got {v!r}")
            if v < 0:
                raise CalibrationError(f"{source}: coef.{k} must be >= 0, got {v!r}")
            values[k] = float(v)
        nums: dict[str, float] = {}
        for k in ("r2", "points", "anchor_blocks_per_sample"):
            v = d.get(k)
            if not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v):
                raise CalibrationError(f"{source}: {k} must be a finite number, got {v!r}")
            nums[k] = float(v)
        meta = d.get("meta", {})
        return cls(
            coef=values,
            r2=nums["r2"],
            points=int(nums["points"]),
            anchor_blocks_per_sample=nums["anchor_blocks_per_sample"],
            meta=dict(meta) if isinstance(meta, dict) else {},
        )

    @classmethod
    def load(cls, path: str | Path) -> StepCostModel:
        p = Path(path)
        try:
            raw = json.loads(p.read_text())
        except OSError as exc:
            raise CalibrationError(f"{p}: cannot read: {exc.strerror or exc}") from None
        except json.JSONDecodeError as exc:
            raise CalibrationError(f"{p}: not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise CalibrationError(f"{p}: expected a JSON object")
        return cls.from_json_dict(raw, str(p))

    def describe(self) -> str:
        """Coefficients in readable units and R^2, one line."""
        c = self.coef
        return (
            f"step cost: {c['padded_tokens'] * 1e9:.3g} ns/padded token, "
            f"{c['padded_sq'] * 1e12:.3g} ps/row-length^2, {c['anchor_blocks'] * 1e6:.3g} us/anchor "
            f"block, {c['samples'] * 1e6:.3g} us/sample, {c['batches'] * 1e3:.3g} ms/micro-batch; "
            f"R^2 {self.r2:.3f} over {self.points} windows"
        )


def nnls(a: np.ndarray, b: np.ndarray, max_iter: int = 200) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson-Hanson active set; small dense problems)."""
    m, n = a.shape
    x = np.zeros(n)
    passive = np.zeros(n, dtype=bool)
    w = a.T @ (b - a @ x)
    tol = 1e-12 * max(1.0, float(np.abs(a).max(initial=0.0))) * max(m, n)
    for _ in range(max_iter):
        if passive.all() or not (w[~passive] > tol).any():
            break
        j = int(np.argmax(np.where(passive, -np.inf, w)))
        passive[j] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > 0).all():
                x = z
                break
            neg = passive & (z <= 0)
            alpha = float(np.min(x[neg] / (x[neg] - z[neg])))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        w = a.T @ (b - a @ x)
    return x


def fit_step_cost(features: np.ndarray, seconds: np.ndarray) -> tuple[dict[str, float], float]:
    """Non-negative least squares of `seconds` on the feature columns; (coef, R^2).

    Rows are timed windows (features summed over the window's micro-batches). Columns are
    scaled to unit norm first so the active set is not decided by units."""
    x = np.asarray(features, dtype=np.float64)
    y = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or x.shape[1] != len(FEATURES) or len(x) != len(y):
        raise CalibrationError(f"fit needs an (n, {len(FEATURES)}) feature matrix and n timings")
    if len(y) < 2:
        raise CalibrationError(f"fit needs at least 2 timed windows, got {len(y)}")
    scale = np.linalg.norm(x, axis=0)
    scale[scale == 0] = 1.0
    beta = nnls(x / scale, y) / scale
    resid = y - x @ beta
    ss_tot = float(((y - y.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / ss_tot if ss_tot > 0 else 1.0
    return {k: float(v) for k, v in zip(FEATURES, beta, strict=True)}, r2


def eligible_counts(mask: np.ndarray, offsets: np.ndarray, chunk_rows: int = 65536) -> np.ndarray:
    """Anchor-eligible positions per row (supervised, next token supervised: the objective's
    rule, `trainer.model.masks.eligible_anchors`), from a store's flat mask and row offsets."""
    n = len(offsets) - 1
    out = np.zeros(n, dtype=np.int64)
    for r0 in range(0, n, chunk_rows):
        r1 = min(n, r0 + chunk_rows)
        lo, hi = int(offsets[r0]), int(offsets[r1])
        m = np.asarray(mask[lo:hi], dtype=bool)
        pair = np.zeros(len(m), dtype=np.int64)
        if len(m) > 1:
            pair[:-1] = m[:-1] & m[1:]
        cum = np.concatenate(([0], np.cumsum(pair)))
        starts = offsets[r0:r1].astype(np.int64) - lo
        ends = offsets[r0 + 1 : r1 + 1].astype(np.int64) - lo
        # a row's last position has no next token inside the row: pair[end - 1] belongs to the
        # next row's first token, so it is excluded
        last = np.maximum(ends - 1, starts)
        out[r0:r1] = cum[last] - cum[starts]
    return out


def row_features(
    rows: int, width: int, samples: int, anchor_blocks: int, row_lengths: Sequence[int] = ()
) -> np.ndarray:
    """One micro-batch's feature vector: `rows` rows padded to `width` (or `row_lengths` each)."""
    widths = np.asarray(row_lengths if len(row_lengths) else [width] * rows, dtype=np.float64)
    return np.array(
        [widths.sum(), (widths**2).sum(), float(anchor_blocks), float(samples), 1.0],
        dtype=np.float64,
    )


def batch_features(
    batch: Batch,
    eligible: np.ndarray,
    num_anchors: int,
    document_lengths: np.ndarray | None = None,
) -> np.ndarray:
    """Features of one micro-batch: `num_rows` rows of `max_len` tokens. A padded batch (one
    sample per row) draws min(num_anchors, most eligible in the batch) blocks per row
    (`masks.sample_anchors`); a packed one (`row_sizes`) min(num_anchors, eligible) per document.

    `document_lengths` (every sample's length): the target attends per document
    (`TargetModel.attends_per_document`), so a packed batch's squared term is the sum of its
    documents' squared lengths, not rows x row width squared (which would price a row of 1024
    tokens 40x its documents' attention)."""
    e = np.minimum(eligible[batch.indices], num_anchors)
    packed = batch.row_sizes is not None
    blocks = int(e.sum()) if packed else len(batch.indices) * int(e.max(initial=0))
    out = row_features(batch.num_rows, batch.max_len, len(batch.indices), blocks)
    if packed and document_lengths is not None:
        out[1] = float((document_lengths[batch.indices].astype(np.float64) ** 2).sum())
    return out


def segment_times(
    model: StepCostModel, padded: np.ndarray, counts: np.ndarray, batches: np.ndarray
) -> np.ndarray:
    """Predicted seconds of every DP segment from its expected padded tokens, samples and
    batches (`trainer.bucketing.dp.segment_stats`).

    The squared-width term is padded^2 / samples: exact when every batch of the segment pads
    to the same width, a lower bound otherwise (Cauchy-Schwarz), close for a narrow bucket.
    Anchor blocks are `anchor_blocks_per_sample` per sample (the planner sees only lengths)."""
    c = model.coef
    with np.errstate(invalid="ignore", divide="ignore"):
        sq = np.where(counts > 0, padded * padded / np.maximum(counts, 1), np.inf)
        per_sample = c["samples"] + c["anchor_blocks"] * model.anchor_blocks_per_sample
        out: np.ndarray = (
            c["padded_tokens"] * padded
            + c["padded_sq"] * sq
            + per_sample * counts
            + c["batches"] * batches
        )
    return np.where(np.isfinite(padded) & np.isfinite(batches), out, np.inf)


def epoch_features(batches: Sequence[Batch], anchor_blocks_per_sample: float) -> np.ndarray:
    """Summed features of an epoch's padded batches from lengths only (the planner's view)."""
    total = np.zeros(len(FEATURES))
    for b in batches:
        total += row_features(b.num_rows, b.max_len, len(b.indices), 0)
    total[2] = anchor_blocks_per_sample * total[3]
    return total
