"""`batching.row_length` unset: packed rows are the store's manifest max_length long (capped at
the token budget), as the trainer and the memory estimate build them; without a recorded
max_length, the longest sample."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from trainer.buckets import sampler_for
from trainer.config import BatchingConfig, TrainConfig
from trainer.data.store import TokenStore

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ROOT / "tests" / "fixtures" / "qwen3-8b" / "config.json"
LENGTHS = np.random.default_rng(3).integers(20, 200, 200)


def _batching(**kw: object) -> BatchingConfig:
    return BatchingConfig.model_validate({"token_budget": 1024, "max_batch": 16, **kw})


@pytest.mark.parametrize(
    ("kw", "max_length", "want"),
    [
        ({"strategy": "packed"}, 256, 256),  # the store's max_length
        ({"strategy": "packed"}, 4096, 1024),  # capped at the budget: a batch holds a row
        ({"strategy": "packed"}, None, int(LENGTHS.max())),  # nothing recorded: the longest
        ({"strategy": "packed", "row_length": 300}, 256, 300),  # the key, when set, wins
        ({"strategy": "sorted"}, 256, None),  # no rows for the padded strategies
    ],
)
def test_sampler_for_takes_the_stores_max_length(
    kw: dict[str, object], max_length: int | None, want: int | None
) -> None:
    sampler = sampler_for(_batching(**kw), LENGTHS, seed=0, max_length=max_length)
    assert sampler.row_length == want
    if want is not None:
        batches = sampler.epoch_batches(0)
        assert all(b.max_len <= want and b.num_rows * want <= 1024 for b in batches)
        assert sum(b.real_tokens for b in batches) == int(LENGTHS.sum())


def _run(tmp_path: Path) -> TrainConfig:
    """A packed config over a synthetic store whose manifest says max_length 256 (its longest
    row is 199 tokens)."""
    from trainer.data.synth import synth_store

    lengths = tmp_path / "lengths.npy"
    np.save(lengths, LENGTHS)
    synth_store(
        tmp_path / "store", lengths_from=str(lengths), vocab_size=512, seed=0, max_length=256
    )
    (tmp_path / "target").mkdir()
    target = json.loads(QWEN3_8B.read_text())
    target.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, head_dim=16)
    target.update(num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    (tmp_path / "target" / "config.json").write_text(json.dumps(target))
    path = tmp_path / "run.toml"
    path.write_text(
        'seed = 0\n[data]\nstore = "store"\n[batching]\nstrategy = "packed"\n'
        'token_budget = 1024\nmax_batch = 16\n[model]\ntarget_dir = "target"\n'
        "mask_token_id = 511\nnum_anchors = 8\n[model.drafter]\nnum_layers = 1\n"
        'block_size = 4\n[topology]\ntarget_devices = ["cuda:1"]\ndrafter_devices = ["cuda:0"]\n'
    )
    return TrainConfig.load(path)


def test_the_memory_estimate_packs_rows_of_the_stores_max_length(tmp_path: Path) -> None:
    from trainer.memory.batches import batch_shapes

    cfg = _run(tmp_path)
    store = TokenStore.open(tmp_path / "store")
    assert store.manifest.max_length == 256 and int(np.max(store.lengths)) == int(LENGTHS.max())
    assert int(LENGTHS.max()) < 256
    assert batch_shapes(cfg).row_length == 256


def test_the_trainer_packs_rows_of_the_stores_max_length(tmp_path: Path) -> None:
    """The trainer's own plans (`build.plans_for`, what every rank builds): rows of the
    manifest's 256 tokens, so a batch holds token_budget // 256 = 4 rows at most; the same
    row_length the memory estimate uses."""
    from trainer.pipeline.build import plans_for

    cfg = _run(tmp_path)
    _, plans = plans_for(cfg, 2)
    for plan in plans:
        assert plan.sampler.row_length == 256
        batches = plan.sampler.epoch_batches(0)
        assert max(b.num_rows for b in batches) <= 4 and max(b.max_len for b in batches) <= 256
        assert max(b.max_len for b in batches) > int(LENGTHS.max())  # rows longer than a sample
