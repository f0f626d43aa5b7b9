"""The packed row length under the time objective (issue 14 item 2, "and for packing, row
length"): the candidates, each one's epoch exactly as the sampler batches it, the choice under
a calibration, and `plan --strategy packed`. Torch-free."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainer.bucketing.row_length import (
    best_row_length,
    row_length_candidates,
    row_length_options,
)
from trainer.bucketing.timecost import FEATURES, StepCostModel, batch_features
from trainer.buckets import main
from trainer.data.lengths import seed_shaped_lengths
from trainer.sampler import BatchSampler

LENGTHS = seed_shaped_lengths(3000, seed=0) // 32 + 2


def model(document_attention: bool, **coef: float) -> StepCostModel:
    full = {k: coef.get(k, 0.0) for k in FEATURES}
    return StepCostModel(full, 1.0, 10, 8.0, {"document_attention": document_attention})


def test_candidates_are_the_longest_sample_and_every_budget_share_above_it() -> None:
    assert row_length_candidates(160, 1024) == [160, 170, 204, 256, 341, 512, 1024]
    assert row_length_candidates(600, 1024) == [600, 1024]
    assert row_length_candidates(1024, 1024) == [1024]
    many = row_length_candidates(3, 100_000)
    assert len(many) == 12 and many[0] == 3 and many[-1] == 100_000


def test_each_option_is_the_samplers_own_epoch_priced_by_the_model() -> None:
    m = model(False, padded_tokens=1e-6, padded_sq=1e-9, samples=1e-4, batches=5e-3)
    longest = int(LENGTHS.max())
    options = row_length_options(LENGTHS, token_budget=1024, max_batch=16, model=m, seed=3)
    assert [o.row_length for o in options] == row_length_candidates(longest, 1024)
    for o in options:
        batches = BatchSampler(
            LENGTHS,
            strategy="packed",
            token_budget=1024,
            max_batch=16,
            seed=3,
            row_length=o.row_length,
        ).epoch_batches(0)
        zeros = np.zeros(len(LENGTHS), dtype=np.int64)
        feats = np.stack([batch_features(b, zeros, 0) for b in batches])
        feats[:, 2] = 8.0 * feats[:, 3]
        assert o.batches == len(batches)
        assert o.predicted_s == pytest.approx(float(m.predict(feats).sum()))
        assert o.tokens_s == pytest.approx(int(LENGTHS.sum()) / o.predicted_s)
        assert o.samples_s == pytest.approx(len(LENGTHS) / o.predicted_s)
        assert 0.5 < o.row_fill <= o.padding_efficiency <= 1.0


def test_per_document_attention_favours_long_rows_whole_row_attention_short_ones() -> None:
    """The same coefficients: priced per document, squared lengths do not grow with the row,
    so the fewest micro-batches win (the budget-long row); priced over whole rows, a row of
    1024 costs many times its documents' attention and a shorter row wins."""
    coef = {"padded_tokens": 1e-6, "padded_sq": 1e-8, "samples": 1e-4, "batches": 5e-3}
    per_doc = row_length_options(
        LENGTHS, token_budget=1024, max_batch=16, model=model(True, **coef)
    )
    whole = row_length_options(LENGTHS, token_budget=1024, max_batch=16, model=model(False, **coef))
    fewest = min(per_doc, key=lambda o: o.batches)
    assert best_row_length(per_doc).row_length == fewest.row_length == 1024
    assert best_row_length(whole).row_length < 1024
    assert best_row_length(whole) == min(whole, key=lambda o: o.predicted_s)
    # the squared term is the only difference, and only where rows hold several documents
    assert all(d.predicted_s < w.predicted_s for d, w in zip(per_doc, whole, strict=True))


def test_ties_go_to_the_shorter_row() -> None:
    options = row_length_options(LENGTHS, token_budget=1024, max_batch=16, model=model(True))
    assert best_row_length(options).row_length == int(LENGTHS.max())


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, LENGTHS)
    cal = tmp_path / "cal.json"
    model(True, padded_tokens=1e-6, samples=1e-4, batches=5e-3).save(cal)
    return lengths, cal


def test_plan_strategy_packed_prints_every_candidate_and_the_choice(
    files: tuple[Path, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    lengths, cal = files
    argv = ["plan", "--strategy", "packed", "--lengths", str(lengths), "--token-budget", "1024"]
    argv += ["--max-batch", "16", "--objective", "time", "--calibration", str(cal)]
    assert main([*argv, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["strategy"] == "packed" and d["row_length"] == 1024 and d["document_attention"]
    assert [o["row_length"] for o in d["options"]] == row_length_candidates(
        int(LENGTHS.max()), 1024
    )
    assert set(d["options"][0]) == {
        "row_length", "batches", "row_fill", "padding_efficiency", "predicted_s", "samples_s",
        "tokens_s",
    }  # fmt: skip
    assert main(argv) == 0
    table = capsys.readouterr().out
    assert "target attention per document" in table
    assert 'strategy = "packed", row_length = 1024' in table
    starred = [ln for ln in table.splitlines() if ln.startswith("*")]
    assert len(starred) == 2 and starred[0].split()[1] == "1024"


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        (["--strategy", "packed"], "error: --strategy: packed has no boundaries"),
        ([], "error: --buckets: the number of buckets K is required"),
        (["--strategy", "packed", "--buckets", "4"], "error: --buckets: packed rows have no"),
    ],
)
def test_plan_without_what_a_strategy_needs_is_one_line(
    files: tuple[Path, Path], capsys: pytest.CaptureFixture[str], extra: list[str], needle: str
) -> None:
    lengths, _ = files
    argv = ["plan", "--lengths", str(lengths), "--token-budget", "1024", "--max-batch", "16"]
    assert main([*argv, *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith(needle) and err.count("\n") == 1, err
