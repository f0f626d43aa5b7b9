"""`trainer.memory` on packed batches: one shape row per packed row, its anchors the sum of its
documents' per-document draws (what the drafter step draws with every anchor kept), and the
CLI's peak on a packed config against the padded strategies on the same store."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from trainer.buckets import sampler_for
from trainer.config import TrainConfig
from trainer.data.store import TokenStore
from trainer.memory.batches import BatchShape, batch_shapes, load_lengths_and_eligible
from trainer.model.masks import sample_anchors
from trainer.pipeline.collate import collate_batch

ROOT = Path(__file__).resolve().parents[2]
QWEN3_8B = ROOT / "tests" / "fixtures" / "qwen3-8b" / "config.json"
BLOCK = 4


def _assets(tmp_path: Path) -> None:
    """A 300-row synthetic store (20..199 tokens, prompts unsupervised) and a tiny target."""
    from trainer.data.synth import synth_store

    lengths = tmp_path / "lengths.npy"
    np.save(lengths, np.random.default_rng(1).integers(20, 200, 300))
    synth_store(tmp_path / "store", lengths_from=str(lengths), vocab_size=512, seed=0)
    (tmp_path / "target").mkdir()
    cfg = json.loads(QWEN3_8B.read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4)
    cfg.update(num_key_value_heads=2, head_dim=16, vocab_size=512)
    (tmp_path / "target" / "config.json").write_text(json.dumps(cfg))


def _config(
    tmp_path: Path, name: str, batching: str, num_anchors: int, device: str = "cuda:0"
) -> Path:
    text = (
        f'seed = 0\n[data]\nstore = "store"\n[batching]\n{batching}\n'
        'token_budget = 1024\nmax_batch = 16\n[model]\ntarget_dir = "target"\n'
        f"mask_token_id = 511\nnum_anchors = {num_anchors}\n[model.drafter]\nnum_layers = 2\n"
        f'block_size = {BLOCK}\n[topology]\ntarget_devices = ["cuda:1"]\n'
        f'drafter_devices = ["{device}"]\n[schedule]\nepochs = 2\n'
    )
    path = tmp_path / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("num_anchors", [6, 1000])
def test_packed_shapes_are_the_rows_the_drafter_step_draws(
    tmp_path: Path, num_anchors: int
) -> None:
    """Every packed batch of both epochs, collated as the trainer collates it and drawn by
    `masks.sample_anchors` (the drafter step's per-document rule) with num_anchors as configured: its
    kept anchors per row, its width and so its query rows are the estimate's shape for it, and
    the estimate's shapes are exactly those. num_anchors 6 caps most documents (a packed row's
    width is then several documents' 6); 1000 takes every eligible position."""
    _assets(tmp_path)
    cfg = TrainConfig.load(_config(tmp_path, "packed", 'strategy = "packed"', num_anchors))
    shapes = batch_shapes(cfg)
    store = TokenStore.open(tmp_path / "store")
    lengths, _, _, exact = load_lengths_and_eligible(cfg)
    sampler = sampler_for(cfg.batching, lengths, seed=0)
    assert exact and shapes.row_length == sampler.row_length
    drawn: set[BatchShape] = set()
    several = 0
    generator = torch.Generator().manual_seed(0)
    for epoch in range(2):
        for batch in sampler.epoch_batches(epoch):
            host = collate_batch(store, batch.max_len, batch, pin=False)
            assert host.position_ids is not None
            anchors = sample_anchors(
                host.loss_mask, host.attention_mask, num_anchors, generator, host.position_ids
            )
            per_row = tuple(anchors.keep.sum(1).tolist())
            shape = BatchShape(batch.max_len, per_row)
            assert shape.rows == batch.num_rows == host.input_ids.shape[0]
            assert shape.query_rows(BLOCK) == anchors.keep.numel() * BLOCK  # rows x width x B
            several += int(max(per_row) > num_anchors)
            drawn.add(shape)
    assert set(shapes.batches) == drawn and shapes.num_batches == sum(
        len(sampler.epoch_batches(e)) for e in range(2)
    )
    if num_anchors == 6:  # rows whose documents together hold more than one document's cap
        assert several > 0


@pytest.mark.parametrize("num_anchors", [6, 1000])
def test_under_sdpa_the_shapes_are_the_documents_the_step_lays_out(
    tmp_path: Path, num_anchors: int
) -> None:
    """A CPU drafter (SDPA): the step lays each packed batch's documents with an anchor out
    one per row (`trainer.model.documents.unpack_documents`, after the draw); the estimate's
    shapes are exactly those rows (width = the longest such document, anchors per document)
    and remember the packed packet the target captured."""
    from trainer.model.documents import unpack_documents

    _assets(tmp_path)
    config = _config(tmp_path, "packed", 'strategy = "packed"', num_anchors, device="cpu")
    cfg = TrainConfig.load(config)
    shapes = batch_shapes(cfg)
    store = TokenStore.open(tmp_path / "store")
    sampler = sampler_for(cfg.batching, load_lengths_and_eligible(cfg)[0], seed=0)
    want: set[BatchShape] = set()
    generator = torch.Generator().manual_seed(0)
    for epoch in range(2):
        for batch in sampler.epoch_batches(epoch):
            host = collate_batch(store, batch.max_len, batch, pin=False)
            assert host.position_ids is not None
            anchors = sample_anchors(
                host.loss_mask, host.attention_mask, num_anchors, generator, host.position_ids
            )
            assert anchors.num_blocks > 0  # every batch here has anchors: the step unpacks
            u = unpack_documents(
                host.input_ids, host.loss_mask, host.attention_mask, host.position_ids, anchors
            )
            per_row = tuple(u.anchors.keep.sum(1).tolist())
            packet = (batch.num_rows, batch.max_len)
            want.add(BatchShape(u.input_ids.shape[1], per_row, packet))
    assert set(shapes.batches) == want
    assert all(s.packet is not None and s.seq <= s.packet[1] for s in shapes.batches)
    assert set(batch_shapes(cfg, unpack=False).batches) != want  # the flex (CUDA) shapes


def _peak(config: Path) -> tuple[int, dict[str, Any]]:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer.memory", "--config", str(config), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    rep = json.loads(proc.stdout)
    drafter = next(d for d in rep["devices"] if d["device"] == "cuda:0")
    return int(drafter["peak"]), rep


def test_the_cli_on_a_packed_config_prints_a_peak_no_larger_than_padded(tmp_path: Path) -> None:
    """Same store, same token budget and max_batch, every eligible position anchored (the
    regime of the packed == padded equivalence tests): the packed run's drafter peak is at most
    the bucketed (default) and the sorted runs'. Both are bounded by the token budget, but a
    padded batch's width is its widest row's anchors, charged to every row, while a packed row's
    is only its own documents' eligible positions (each pays its own unsupervised prompt and
    last position); and the packed rows, not the documents, are the batch's rows."""
    _assets(tmp_path)
    packed, rep = _peak(_config(tmp_path, "packed", 'strategy = "packed"', 1000))
    bucketed, _ = _peak(_config(tmp_path, "bucketed", "num_buckets = 4", 1000))
    sorted_, _ = _peak(_config(tmp_path, "sorted", 'strategy = "sorted"', 1000))
    assert (
        rep["strategy"] == "packed" and rep["row_length"] == 199
    )  # the manifest max_length (the longest)
    worst = rep["drafter"]["unbounded"]["worst_batch"]
    assert worst["rows"] * worst["seq"] <= 1024  # rows x fullest row within the budget
    assert packed <= bucketed and packed <= sorted_, (packed, bucketed, sorted_)
    text = subprocess.run(
        [sys.executable, "-m", "trainer.memory", "--config", str(tmp_path / "packed.toml")],
        capture_output=True,
        text=True,
        cwd=ROOT,
    ).stdout
    assert "packed rows of 199 tokens" in text
