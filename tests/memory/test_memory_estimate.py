"""`trainer.memory`: the per-op byte counts against the allocator's own peak on CPU, the batch
shapes against the sampler and the trainer's split, and the CLI's verdicts and errors."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch

from trainer.config import TrainConfig
from trainer.memory.batches import BatchShape, batch_shapes, pieces
from trainer.memory.costs import Backend, Piece, activation_peak
from trainer.memory.estimate import Estimator, Precision, precision_for
from trainer.memory.measure import measured_peak
from trainer.memory.shapes import DrafterShape, drafter_shape, read_target_shape
from trainer.model.masks import Anchors, eligible_anchors
from trainer.model.split_step import split_pieces

ROOT = Path(__file__).resolve().parents[2]
SEED_CONFIG = ROOT / "configs" / "qwen3-8b-6x1.toml"
QWEN3_8B = ROOT / "tests" / "fixtures" / "qwen3-8b" / "config.json"
TOLERANCE = 0.15  # the bar: predicted within 15 % of measured


@pytest.mark.parametrize(
    ("shape", "piece", "bf16"),
    [
        (DrafterShape(64, 192, 2, 4, 2, 16, 512, 4, 3), Piece(4, 64, 8), False),
        (DrafterShape(128, 384, 3, 8, 2, 16, 1024, 16, 3), Piece(8, 32, 4), False),
        (DrafterShape(96, 256, 2, 6, 3, 16, 768, 8, 3), Piece(1, 256, 64), True),
        (DrafterShape(128, 384, 3, 8, 2, 16, 1024, 8, 3), Piece(2, 128, 32), True),
    ],
)
def test_predicted_peak_is_within_15_percent_of_the_allocator_peak(
    shape: DrafterShape, piece: Piece, bf16: bool
) -> None:
    """One real forward+backward (SDPA, chunked CE; bf16 = CPU autocast, whose weight casts are
    made inside the step, so they count) measured by the profiler's allocation events."""
    c = 2 if bf16 else 4
    predicted = activation_peak(shape, piece, c=c, feature_bytes=c, backend="sdpa")
    predicted += 2 * shape.linear_params if bf16 else 0
    measured = measured_peak(shape, piece, bf16=bf16)
    assert abs(predicted / measured - 1) <= TOLERANCE, (predicted, measured)


def test_query_row_cost_at_real_width() -> None:
    """Qwen3-8B drafter (5 layers, H 4096, I 12288, 32/8 heads): ~264 KiB per query row per
    layer saved under bf16 autocast, the issue's ~256 KiB hook measurement at real widths."""
    from trainer.memory.costs import per_query_row_layer

    d = DrafterShape(4096, 12288, 5, 32, 8, 128, 151936, 16, 5)
    per_layer = per_query_row_layer(d, 2, "flex")
    assert 240 * 1024 <= per_layer <= 290 * 1024
    assert 1_000_000_000 < d.params < 1_100_000_000  # ~1.05 B (reference: 5 x 193 M + 84 M)


def test_piece_shapes_are_the_trainers_split() -> None:
    """The torch-free twin yields exactly the pieces `split_pieces` cuts (rows, widths)."""
    g = np.random.default_rng(0)
    for _ in range(200):
        rows, block = int(g.integers(1, 9)), int(g.choice([2, 4, 16]))
        per_row = g.integers(0, 40, rows).tolist()
        width = max(per_row)
        keep = torch.tensor([[j < k for j in range(width)] for k in per_row], dtype=torch.bool)
        anchors = Anchors(torch.zeros(rows, width, dtype=torch.long), keep)
        budget = None if g.random() < 0.1 else int(g.integers(1, 400))
        if width == 0:
            continue
        want = [
            Piece(r.stop - r.start, 77, int(keep[r, c].sum(1).max()))
            for r, c in split_pieces(anchors, block, budget)
        ]
        got = list(pieces(BatchShape(77, tuple(per_row)), block, budget))
        assert got == want, (per_row, block, budget)


def _random_shapes(g: np.random.Generator, n: int) -> list[BatchShape]:
    """Shapes with zero-anchor rows, rows wider than any budget, and unpacked packets."""
    out = []
    for _ in range(n):
        per_row = g.integers(0, 60, int(g.integers(1, 9))) * (g.random(1) < 0.9)
        packet = (int(g.integers(1, 4)), int(g.integers(64, 400))) if g.random() < 0.3 else None
        out.append(BatchShape(int(g.integers(8, 300)), tuple(per_row.tolist()), packet))
    return out


def test_the_piece_table_is_every_shapes_pieces() -> None:
    """All shapes' pieces at once (`piece_table`) = each shape's `pieces(widest_run=True)`."""
    from trainer.memory.batches import ShapeTable, piece_table

    g = np.random.default_rng(3)
    for _ in range(40):
        shapes = _random_shapes(g, int(g.integers(1, 60)))
        block = int(g.choice([2, 4, 16]))
        budget = None if g.random() < 0.1 else int(g.integers(1, 500))
        table = ShapeTable.of(shapes)
        got = piece_table(table, block, budget)
        for i, shape in enumerate(shapes):
            mine = got.shape == i
            have = sorted(
                (int(r), shape.seq, int(w), int(table.packed_tokens[i]))
                for r, w in zip(got.rows[mine], got.width[mine], strict=True)
            )
            want = sorted(
                (p.rows, p.seq, p.width, p.packed_tokens)
                for p in pieces(shape, block, budget, widest_run=True)
            )
            assert have == want, (shape, block, budget)


def test_the_plan_is_the_worst_shape_priced_one_at_a_time(tmp_path: Path) -> None:
    """`Estimator.plan` (every shape priced at once) picks the peak, shape and piece of
    pricing each shape's pieces one at a time, first worst first, fp32/SDPA and bf16/flex."""
    from trainer.memory.batches import Shapes

    g = np.random.default_rng(4)
    for noise in (0.0, 0.5):
        cfg = TrainConfig.load(_tiny_run(tmp_path / str(noise), noise=noise))
        target = read_target_shape(tmp_path / str(noise) / "target")
        d = drafter_shape(cfg, target)
        modes: tuple[tuple[int, Backend], ...] = ((4, "sdpa"), (2, "flex"))
        for c, backend in modes:
            shapes = _random_shapes(g, 80)
            shapes.append(shapes[5])  # a tie: the first of equal shapes wins
            est = Estimator(
                cfg,
                target,
                d,
                Shapes(shapes, "test", True, len(shapes), 1, row_length=None),
                Precision(c, c, backend),
            )
            for budget in (None, 1, 7, 64, 333):
                best = None
                for shape in shapes:
                    packet = est.packet_bytes(shape)
                    extra = packet * (2 if noise else 1) + est.unpacked_bytes(shape)
                    act, piece = max(
                        (
                            (activation_peak(d, p, c=c, feature_bytes=c, backend=backend), p)
                            for p in pieces(shape, d.block, budget, widest_run=True)
                        ),
                        key=lambda t: t[0],
                    )
                    if best is None or act + extra > best[0]:
                        best = (act + extra, shape, piece, act)
                plan = est.plan(budget)
                assert best is not None
                assert (plan.peak, plan.worst, plan.worst_piece, plan.activations) == best


def _tiny_run(tmp_path: Path, **model: object) -> Path:
    from trainer.data.synth import synth_store

    tmp_path.mkdir(exist_ok=True)
    lengths = tmp_path / "lengths.npy"
    np.save(lengths, np.random.default_rng(1).integers(20, 200, 300))
    synth_store(tmp_path / "store", lengths_from=str(lengths), vocab_size=512, seed=0)
    (tmp_path / "target").mkdir()
    cfg = json.loads(QWEN3_8B.read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4)
    cfg.update(num_key_value_heads=2, head_dim=16, vocab_size=512)
    (tmp_path / "target" / "config.json").write_text(json.dumps(cfg))
    extra = "".join(f"{k} = {v}\n" for k, v in model.items())
    text = (
        'seed = 0\n[data]\nstore = "store"\n[batching]\nboundaries = [1, 100, 201]\n'
        'token_budget = 1024\nmax_batch = 8\n[model]\ntarget_dir = "target"\n'
        f"mask_token_id = 511\nnum_anchors = 32\n{extra}[model.drafter]\nnum_layers = 2\n"
        'block_size = 4\n[topology]\ntarget_devices = ["cuda:1"]\ndrafter_devices = ["cuda:0"]\n'
        "[schedule]\nepochs = 2\n"
    )
    path = tmp_path / "run.toml"
    path.write_text(text)
    return path


def test_anchor_counts_come_from_the_stores_loss_mask(tmp_path: Path) -> None:
    """Per row anchors = min(num_anchors, eligible) with eligible counted as the objective does;
    the batch shapes cover every batch of both epochs."""
    from trainer.data.store import TokenStore
    from trainer.memory.batches import load_lengths_and_eligible
    from trainer.sampler import BatchSampler

    cfg = TrainConfig.load(_tiny_run(tmp_path))
    lengths, eligible, source, exact = load_lengths_and_eligible(cfg)
    store = TokenStore.open(tmp_path / "store")
    want = [
        int(eligible_anchors(torch.from_numpy(store.row(i)[1].copy())[None]).sum())
        for i in range(len(store))
    ]
    assert exact and "store" in source and eligible.tolist() == want
    assert (eligible < lengths - 1).any()  # prompts are unsupervised: not the length bound
    shapes = batch_shapes(cfg)
    sampler = BatchSampler(
        lengths, boundaries=[1, 100, 201], token_budget=1024, max_batch=8, seed=0
    )
    every = {
        BatchShape(b.max_len, tuple(np.minimum(eligible[b.indices], 32).tolist()))
        for e in range(2)
        for b in sampler.epoch_batches(e)
    }
    assert set(shapes.batches) == every and shapes.epochs == 2


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "trainer.memory", *args], capture_output=True, text=True, cwd=ROOT
    )


def test_cli_verdict_and_json_on_a_real_store(tmp_path: Path) -> None:
    """Fits in 1 GiB with room; a budget below the fixed costs says so and exits 1."""
    cfg = _tiny_run(tmp_path)
    ok = _cli("--config", str(cfg), "--device-memory", "2GiB", "--reserve", "0", "--json")
    assert ok.returncode == 0, ok.stderr
    rep = json.loads(ok.stdout)
    assert rep["fits"] and rep["anchors_exact"] and rep["key"] == "model.max_query_rows"
    assert [d["device"] for d in rep["devices"]] == ["cuda:1", "cuda:0"]
    assert (
        rep["drafter"]["largest_max_query_rows"]
        == rep["drafter"]["unbounded"]["worst_batch"]["query_rows"]
    )
    tight = _cli("--config", str(cfg), "--device-memory", "5MiB", "--reserve", "0")
    assert tight.returncode == 1 and "DOES NOT FIT" in tight.stdout
    budget = int(tight.stdout.split("set model.max_query_rows = ")[1].split()[0])
    assert 0 < budget < rep["drafter"]["unbounded"]["worst_batch"]["query_rows"]
    bounded = _tiny_run(tmp_path / "b", max_query_rows=budget)
    again = _cli("--config", str(bounded), "--device-memory", "5MiB", "--reserve", "0")
    assert again.returncode == 0 and "DOES NOT FIT" not in again.stdout, again.stdout
    none = _cli("--config", str(cfg), "--device-memory", "1MiB", "--reserve", "0")
    assert none.returncode == 1 and "no model.max_query_rows fits" in none.stdout


@pytest.mark.parametrize(
    ("edit", "expect"),
    [
        ("missing-config", "no such config file"),
        ("no-target", "config.json: model.target_dir: no config.json there"),
        ("bad-json", "config.json: unreadable target config"),
        ("no-hidden", "config.json: hidden_size: missing or not a positive integer"),
        ("bad-size", "--device-memory: '96 gigs' is not a size"),
    ],
)
def test_errors_are_one_line_naming_file_and_key_exit_2(
    tmp_path: Path, edit: str, expect: str
) -> None:
    cfg = _tiny_run(tmp_path)
    target = tmp_path / "target" / "config.json"
    args = ["--config", str(cfg)]
    if edit == "missing-config":
        args = ["--config", str(tmp_path / "nope.toml")]
    elif edit == "no-target":
        target.unlink()
    elif edit == "bad-json":
        target.write_text("{")
    elif edit == "no-hidden":
        raw = json.loads(target.read_text())
        del raw["hidden_size"]
        target.write_text(json.dumps(raw))
    else:
        args += ["--device-memory", "96 gigs"]
    proc = _cli(*args)
    assert proc.returncode == 2 and proc.stdout == ""
    assert expect in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.timeout(300)
def test_seed_config_needs_the_budget_and_the_largest_budget_is_the_boundary() -> None:
    """configs/qwen3-8b-6x1.toml on 96 GB: unbounded it cannot fit; at the reported largest
    max_query_rows it does, one block more does not."""
    cfg = TrainConfig.load(SEED_CONFIG)
    target = read_target_shape(QWEN3_8B)
    est = Estimator(cfg, target, drafter_shape(cfg, target), batch_shapes(cfg), precision_for(cfg))
    available = 96 * 10**9 - int(1.5 * 2**30)
    assert est.drafter_peak(None)[0] > 4 * available
    largest = est.largest_budget(available)
    assert largest is not None and largest % 16 == 0 and largest >= 4096
    assert est.drafter_peak(largest)[0] <= available < est.drafter_peak(largest + 16)[0]
    # The shipped config's own budget is the one that fits, with a margin under the boundary.
    assert cfg.model.max_query_rows is not None and cfg.model.max_query_rows < largest
    assert est.drafter_peak(cfg.model.max_query_rows)[0] < 0.95 * available


def test_distillation_packets_carry_one_more_hidden_state() -> None:
    """With kd_weight the packets (drafter and target side) hold the target's last hidden
    state beside the F captured layers: their feature bytes grow by exactly (F + 1) / F."""
    from trainer.config.overlay import merge

    raw = tomllib.loads(SEED_CONFIG.read_text())
    target = read_target_shape(QWEN3_8B)
    ests = []
    for loss in ({}, {"type": "dpace", "kd_weight": 0.5}):
        cfg = TrainConfig.from_dict(merge(raw, {"model": {"loss": loss}}))
        ests.append(
            Estimator(
                cfg, target, drafter_shape(cfg, target), batch_shapes(cfg), precision_for(cfg)
            )
        )
    ce, kd = ests
    f, h, b = ce.drafter.features, ce.drafter.hidden, ce.precision.features
    shape = ce.plan(None).worst
    extra = kd.packet_bytes(shape) - ce.packet_bytes(shape)
    assert (
        extra == shape.packet_tokens * h * b
        and extra * f == ce.packet_bytes(shape) - shape.packet_tokens * 3 * 8
    )
    assert kd.target_device()["captured_features"] * f == ce.target_device()[
        "captured_features"
    ] * (f + 1)


def test_the_estimate_imports_no_torch() -> None:
    """`python -m trainer.memory` runs where torch is not installed (a laptop, a jump host)."""
    code = (
        "import sys; import trainer.memory.cli, trainer.memory.estimate, trainer.memory.batches; "
        "from trainer.memory.cli import main; "
        "assert 'torch' not in sys.modules and 'transformers' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
