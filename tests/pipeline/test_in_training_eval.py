"""In-training evaluation end to end: the held-out rows never train, evaluation leaves training
untouched, tau rises, the best checkpoint is linked and kept, resume keeps the held-out set."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from trainer.config import STRATEGIES, ConfigError, TrainConfig, resume_critical_changes
from trainer.data.store import TokenStore
from trainer.events import EvalEvent, parse_line
from trainer.events.checkpoint_layout import REQUIRED_KEYS
from trainer.model.fit import Row, teacher_forced_streaks, walk_accept_lengths
from trainer.model.target import TargetModel
from trainer.pipeline import assets
from trainer.pipeline.checkpoint import (
    best_checkpoint,
    list_checkpoints,
    load_checkpoint,
    prunable,
    save_checkpoint,
    set_best,
)
from trainer.pipeline.evaluate import supervised_spans
from trainer.pipeline.plan import BatchPlan
from trainer.sampler import BatchSampler, holdout_rows

from .conftest import RunCli, run_two_ranks, write_config

HOLDOUT, EVERY, STEPS = 48, 20, 120
EVAL = {"holdout_rows": HOLDOUT, "every_steps": EVERY, "max_rows": 32}


# --- the held-out rows never train (sampler and plan level) -------------------------------------


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**31),
    world=st.integers(1, 4),
    strategy=st.sampled_from(STRATEGIES),
    n=st.integers(40, 400),
    share=st.floats(0.01, 0.5),
)
def test_held_out_rows_never_reach_any_rank_in_any_epoch(
    seed: int, world: int, strategy: str, n: int, share: float
) -> None:
    """Every rank's plan over 2.5 epochs: no held-out id in any batch, and every other id still
    trains each epoch (exclusion drops nothing else); the selection is a pure, prefix-stable
    function of (rows, count, seed)."""
    lengths = np.random.default_rng(seed).integers(4, 64, size=n)
    count = max(1, int(n * share))
    held = holdout_rows(n, count, seed)
    assert len(set(held.tolist())) == count and np.array_equal(held, holdout_rows(n, count, seed))
    assert np.array_equal(holdout_rows(n, count // 2, seed), held[: count // 2])
    kw: dict[str, Any] = dict(
        strategy=strategy, token_budget=256, max_batch=8, seed=seed, pool_size=32
    )
    if strategy == "bucketed":
        kw["boundaries"] = [4, 20, 40, 64]
    samplers = [
        BatchSampler(lengths, rank=r, world_size=world, exclude=held, **kw) for r in range(world)
    ]
    plans = [BatchPlan(s, 2.5) for s in samplers]
    assert len({p.total for p in plans}) == 1
    held_set = set(held.tolist())
    per_epoch: dict[int, set[int]] = {}
    for plan in plans:
        for seq in range(plan.total):
            ids = set(plan.batch(seq).indices.tolist())
            assert not ids & held_set, (seq, ids & held_set)
            per_epoch.setdefault(plan.locate(seq).epoch, set()).update(ids)
    for epoch in (0, 1):  # the whole epochs: every non-held-out row, unless dropped for equality
        dropped = set(samplers[0].dropped(epoch).tolist())
        assert per_epoch[epoch] | dropped == set(range(n)) - held_set


def test_no_exclusion_is_the_sampler_every_earlier_checkpoint_knew() -> None:
    lengths = np.random.default_rng(1).integers(4, 64, size=200)
    kw: dict[str, Any] = dict(boundaries=[4, 30, 64], token_budget=256, max_batch=8, seed=5)
    old, new = BatchSampler(lengths, **kw), BatchSampler(lengths, exclude=[], **kw)
    assert old.fingerprint() == new.fingerprint()
    assert all(
        np.array_equal(a.indices, b.indices)
        for a, b in zip(old.epoch_batches(0), new.epoch_batches(0), strict=True)
    )
    held = BatchSampler(lengths, exclude=holdout_rows(200, 10, 5), **kw)
    assert held.fingerprint() != old.fingerprint()
    with pytest.raises(Exception, match="does not match"):
        BatchPlan(held, 1).load_state_dict(BatchPlan(old, 1).state_dict(0))  # other batches


# --- config ---------------------------------------------------------------------------------


def test_eval_config_errors_and_resume_critical_holdout(tiny_assets: dict[str, Any]) -> None:
    with pytest.raises(ConfigError) as info:
        TrainConfig.from_dict({**tiny_assets, "eval": {"every_steps": 10}}, source="run.toml")
    assert str(info.value) == (
        "run.toml: eval: Value error, every_steps needs holdout_rows > 0 or holdout_store "
        "(rows to evaluate on)"
    )
    with pytest.raises(ConfigError, match=r"run.toml: eval.max_rows: Input should be a valid"):
        TrainConfig.from_dict({**tiny_assets, "eval": {"max_rows": 2.5}}, source="run.toml")
    both = {"holdout_rows": 4, "holdout_store": "s", "every_steps": 5}
    with pytest.raises(ConfigError, match=r"holdout_rows and holdout_store exclude each other"):
        TrainConfig.from_dict({**tiny_assets, "eval": both}, source="run.toml")
    with pytest.raises(ConfigError, match=r"prompts needs every_steps or every_minutes"):
        TrainConfig.from_dict(
            {**tiny_assets, "eval": {"holdout_rows": 4, "prompts": "p.jsonl"}}, source="run.toml"
        )
    base = TrainConfig.from_dict({**tiny_assets, "eval": EVAL})
    other = TrainConfig.from_dict({**tiny_assets, "eval": {**EVAL, "holdout_rows": 40}})
    cadence = TrainConfig.from_dict(
        {**tiny_assets, "eval": {"holdout_rows": HOLDOUT, "every_minutes": 5, "max_rows": 8}}
    )
    assert resume_critical_changes(base, other) == ["eval.holdout_rows"]
    assert resume_critical_changes(base, cadence) == []


# --- retention ------------------------------------------------------------------------------


def _state(value: float) -> dict[str, object]:
    state: dict[str, object] = {k: {} for k in REQUIRED_KEYS}
    state["drafter"] = {"fc.weight": torch.full((2,), value)}
    state["optimizer"] = {"state": {}, "param_groups": []}
    return state


def test_retention_keeps_last_every_and_the_best(tmp_path: Path) -> None:
    assert prunable([10, 20, 30, 40, 50], 2, None, set()) == [10, 20, 30]
    assert prunable([10, 20, 30, 40, 50], 2, 20, {10}) == [30]
    for step in (10, 20, 30):
        save_checkpoint(tmp_path, step, _state(step), keep_last=2, keep_every_steps=25)
    link = set_best(tmp_path, 20)
    assert link.is_symlink() and best_checkpoint(tmp_path) == (20, link.resolve())
    for step in (40, 50, 60, 70):
        save_checkpoint(tmp_path, step, _state(step), keep_last=2, keep_every_steps=25)
    # newest 2 (60, 70) + multiples of 25 (50) + the best (20), never a file named best.pt
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 50, 60, 70]
    assert torch.equal(load_checkpoint(link)["drafter"]["fc.weight"], torch.full((2,), 20.0))
    set_best(tmp_path, 70)
    save_checkpoint(tmp_path, 80, _state(80), keep_last=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [70, 80]  # the old best is free
    (tmp_path / "checkpoints" / "step-00000070.pt").unlink()
    assert best_checkpoint(tmp_path) is None  # dangling: no best, never a broken path
    with pytest.raises(Exception, match="complete checkpoint"):
        set_best(tmp_path, 90)


# --- real CPU training ----------------------------------------------------------------------


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _evals(run_dir: Path) -> list[EvalEvent]:
    events = [parse_line(x) for x in (run_dir / "status.log").read_text().splitlines()]
    return [e for e in events if isinstance(e, EvalEvent)]


@pytest.fixture(scope="module")
def no_eval_run(tmp_path_factory: pytest.TempPathFactory, tiny_assets: dict[str, Any]) -> Path:
    """The same held-out exclusion, evaluation off: the reference training sequence."""
    import subprocess

    from .conftest import REPO, cli_env, trainer_argv

    tmp = tmp_path_factory.mktemp("no-eval")
    cfg = write_config(
        tmp / "run.toml",
        tiny_assets,
        schedule={"max_steps": STEPS},
        eval={"holdout_rows": HOLDOUT},
    )
    out = subprocess.run(
        trainer_argv(cfg, tmp / "run"), cwd=REPO, env=cli_env(), capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert not _evals(tmp / "run")
    state = json.loads((tmp / "run" / "run-state.json").read_text())
    held = json.loads((tmp / "run" / "holdout.json").read_text())
    assert state["holdout_rows"] == HOLDOUT and len(held["rows"]) == HOLDOUT
    assert held["evaluated"] == 0  # recorded even with evaluation off
    return tmp / "run"


def _walk_tau(
    cfg: TrainConfig, drafter_state: dict[str, Any], rows: list[int], block: int
) -> float:
    """The existing teacher-forced walk (trainer.model.fit), one row at a time."""
    target_dir = Path(cfg.model.target_dir)
    hf = assets.target_hf_config(target_dir)
    layers = assets.layer_ids_for(cfg, hf)
    dcfg = assets.drafter_config(cfg, hf, layers)
    target = TargetModel.load(target_dir, layers, "cpu")
    cpu = torch.device("cpu")
    borrowed = assets.load_borrowed(target_dir, hf, cpu, torch.float32)
    drafter = assets.build_drafter(dcfg, borrowed, cpu, 0)
    drafter.load_state_dict(drafter_state)
    store = TokenStore.open(Path(cfg.data.store))
    taus = []
    for i in rows:
        ids, mask, _ = store.gather([i])
        row = Row(ids[0].astype(np.int64).tolist(), mask[0].astype(np.int64).tolist())
        streak = teacher_forced_streaks(drafter, target, row)
        lm = torch.tensor([row.loss_mask])
        for s, e in supervised_spans(lm, torch.ones_like(lm))[0]:
            steps = walk_accept_lengths(streak, s, e - s - (block - 1))
            if steps:
                taus.append(sum(steps) / len(steps))
    return sum(taus) / len(taus)


@pytest.mark.timeout(300)
def test_eval_leaves_training_alone_tau_rises_and_the_best_is_kept(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli, no_eval_run: Path
) -> None:
    cfg_path = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": STEPS},
        eval=EVAL,
        checkpoint={"every_steps": 1000, "every_minutes": 60.0, "keep_last": 2},
    )
    run_dir = tmp_path / "run"
    out = run_cli(cfg_path, run_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    # Evaluation on or off: the same training losses, bit for bit.
    assert _losses(run_dir) == _losses(no_eval_run)

    evals = _evals(run_dir)
    assert [e.step for e in evals] == list(range(0, STEPS + 1, EVERY))
    assert all(len(e.acc_at) == 3 and e.extra["rows"] == "32" for e in evals)
    assert all(e.extra["cost"].endswith("%") for e in evals[1:])
    untrained = evals[0].tau
    assert untrained is not None and evals[-1].tau is not None
    assert evals[-1].tau > untrained + 0.1, [e.tau for e in evals]
    # best = highest tau among checkpointable evals, ties to the later step
    scored = [(e.tau, e.step) for e in evals[1:] if e.tau is not None]
    best_step = max(scored)[1]
    assert evals[-1].best == best_step
    found = best_checkpoint(run_dir)
    assert found is not None and found[0] == best_step
    kept = [s for s, _ in list_checkpoints(run_dir)]
    assert best_step in kept and kept[-2:] == [100, 120] and set(kept) <= {100, 120, best_step}
    state = json.loads((run_dir / "run-state.json").read_text())
    assert state["best_step"] == best_step and state["holdout_rows"] == HOLDOUT
    assert 0 < state["eval_share"] < 1

    # The in-training tau is the existing walk's tau on the same rows and weights.
    holdout = json.loads((run_dir / "holdout.json").read_text())
    cfg = TrainConfig.load(cfg_path)
    assert holdout["rows"] == holdout_rows(1200, HOLDOUT, cfg.seed).tolist()
    weights = load_checkpoint(run_dir / "checkpoints" / "step-00000120.pt")["drafter"]
    tau = _walk_tau(cfg, weights, holdout["rows"][: holdout["evaluated"]], block=4)
    assert state["last_eval"]["step"] == STEPS
    assert state["last_eval"]["tau"] == pytest.approx(tau, abs=1e-9)


@pytest.mark.timeout(300)
def test_resume_keeps_the_held_out_set_and_refuses_to_change_it(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli, no_eval_run: Path
) -> None:
    over: dict[str, Any] = {
        "eval": EVAL,
        "checkpoint": {"every_steps": 20, "every_minutes": 60.0, "keep_last": 1},
    }
    first = write_config(tmp_path / "a.toml", tiny_assets, schedule={"max_steps": 40}, **over)
    run_dir = tmp_path / "run"
    assert run_cli(first, run_dir).returncode == 0
    held = (run_dir / "holdout.json").read_text()
    digest = json.loads((run_dir / "run-state.json").read_text())["holdout_sha256"]
    best = best_checkpoint(run_dir)
    assert best is not None

    more = write_config(tmp_path / "b.toml", tiny_assets, schedule={"max_steps": 60}, **over)
    out = run_cli(more, run_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Resuming from checkpoint: step=40" in out.stdout
    assert (run_dir / "holdout.json").read_text() == held
    assert json.loads((run_dir / "run-state.json").read_text())["holdout_sha256"] == digest
    losses, reference = _losses(run_dir), _losses(no_eval_run)
    assert {s: losses[s] for s in range(1, 61)} == {s: reference[s] for s in range(1, 61)}
    resumed = [e for e in _evals(run_dir) if e.step > 40]
    assert [e.step for e in resumed] == [60] and resumed[0].best is not None
    assert resumed[0].best >= best[0]  # the best carried over the resume

    changed = write_config(
        tmp_path / "c.toml",
        tiny_assets,
        schedule={"max_steps": 80},
        **{**over, "eval": {**EVAL, "holdout_rows": HOLDOUT - 8}},
    )
    out = run_cli(changed, run_dir)
    assert out.returncode == 2
    errors = [x for x in out.stdout.splitlines() if x.startswith("ERROR:")]
    assert len(errors) == 1 and "changed eval.holdout_rows" in errors[0], out.stdout


@pytest.mark.timeout(240)
def test_two_ranks_agree_on_evals_and_the_best_checkpoint(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    """Rank 0 evaluates; both ranks take part in each new best's checkpoint (no hang, both RNGs
    saved), and the Eval lines come from rank 0 alone."""

    cfg = write_config(
        tmp_path / "dp.toml",
        tiny_assets,
        topology={"drafter_devices": ["cpu", "cpu"], "target_devices": ["cpu"]},
        schedule={"max_steps": 12},
        eval={"holdout_rows": HOLDOUT, "every_steps": 4, "max_rows": 8},
    )
    run_dir = tmp_path / "run"
    out = run_two_ranks(cfg, run_dir)
    assert out.returncode == 0, (out.stdout[-2000:], out.stderr[-3000:])
    evals = _evals(run_dir)
    assert [e.step for e in evals] == [0, 4, 8, 12]
    best = best_checkpoint(run_dir)
    assert best is not None and best[0] == evals[-1].best
    state = load_checkpoint(best[1])
    assert state["world_size"] == 2 and len(state["rng"]) == 2
    assert state["eval"]["best"][0] == best[0]


def _token_prompts(tiny_assets: dict[str, Any], path: Path, n: int) -> Path:
    """Token-id prompts (the tiny target has no tokenizer): the first tokens of store rows."""
    store = TokenStore.open(Path(tiny_assets["data"]["store"]))
    rows = [store.gather([i])[0][0][:12].astype(int).tolist() for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.timeout(300)
def test_a_finished_run_exports_the_best_and_decodes_the_prompts(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """`[eval] prompts`: real greedy speculative tau at every eval (trainer.eval's loop and its
    greedy check); the last one equals `python -m trainer.eval` on the exported drafter."""
    import subprocess
    import sys

    from safetensors.torch import load_file

    from .conftest import REPO, cli_env

    prompts = _token_prompts(tiny_assets, tmp_path / "prompts.jsonl", 3)
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"epochs": 0.25},
        eval={
            "holdout_rows": HOLDOUT,
            "every_steps": 10,
            "max_rows": 8,
            "prompts": "prompts.jsonl",
            "max_prompts": 2,
            "max_new_tokens": 16,
        },
        checkpoint={"every_steps": 1000, "every_minutes": 60.0, "keep_last": 1},
    )
    run_dir = tmp_path / "run"
    out = run_cli(cfg, run_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    evals = _evals(run_dir)
    assert all(e.tau_real is not None and e.extra["greedy_match"] == "2/2" for e in evals)
    prompts.write_text("".join(prompts.read_text().splitlines(keepends=True)[:2]))
    argv = [sys.executable, "-m", "trainer.eval", "--target", tiny_assets["model"]["target_dir"]]
    argv += ["--drafter", str(run_dir / "export"), "--prompts", str(prompts)]
    argv += ["--max-new-tokens", "16", "--device", "cpu"]
    real = subprocess.run(argv, cwd=REPO, env=cli_env(), capture_output=True, text=True)
    assert real.returncode == 0, real.stdout[-2000:] + real.stderr[-2000:]
    summary = [x for x in real.stdout.splitlines() if x.startswith("all sets: tau=")]
    assert summary and summary[0].split()[2] == f"tau={evals[-1].tau_real:.3f}"
    best = best_checkpoint(run_dir)
    assert best is not None
    assert f"Exported best drafter (step {best[0]}) to" in out.stdout
    weights = load_checkpoint(best[1])["drafter"]
    exported = {}
    for f in sorted((run_dir / "export-best").glob("*.safetensors")):
        exported.update(load_file(f))
    assert exported and all(torch.equal(t, weights[k]) for k, t in exported.items())
    assert (run_dir / "export" / "config.json").is_file()


@pytest.mark.timeout(240)
def test_eval_every_minutes_keeps_the_losses(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli, no_eval_run: Path
) -> None:
    """A time cadence (here 60 ms: several evals per run however fast the steps) goes through
    the step's all-reduce flags and still leaves every training loss as it was."""
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": 30},
        eval={"holdout_rows": HOLDOUT, "every_minutes": 0.001, "max_rows": 4},
    )
    run_dir = tmp_path / "run"
    out = run_cli(cfg, run_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    steps = [e.step for e in _evals(run_dir)]
    assert steps[0] == 0 and steps[-1] == 30 and len(steps) >= 3
    assert steps == sorted(set(steps))
    reference = _losses(no_eval_run)
    assert _losses(run_dir) == {s: reference[s] for s in range(1, 31)}


def test_a_bad_prompt_file_is_refused_before_training(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    (tmp_path / "prompts.jsonl").write_text("[1, 2]\n[1, 2\n")
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        eval={"holdout_rows": HOLDOUT, "every_steps": 10, "prompts": "prompts.jsonl"},
    )
    out = run_cli(cfg, tmp_path / "run")
    assert out.returncode == 2
    errors = [x for x in out.stdout.splitlines() if x.startswith("ERROR:")]
    assert len(errors) == 1
    assert errors[0].startswith(
        f"ERROR: eval.prompts: {tmp_path / 'prompts.jsonl'}:2: invalid JSON"
    )
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.timeout(240)
def test_a_separate_holdout_store_is_evaluated_and_excludes_nothing(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    from trainer.config.overlay import merge

    other = merge(tiny_assets, {"data": {"store": str(tmp_path / "held")}})
    other["data"]["synthetic"] = {**other["data"]["synthetic"], "rows": 40, "seed": 7}
    assets.ensure_store(TrainConfig.from_dict(other))
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": 20},
        eval={"holdout_store": "held", "every_steps": 10, "max_rows": 16},
    )
    run_dir = tmp_path / "run"
    out = run_cli(cfg, run_dir)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    evals = _evals(run_dir)
    assert [e.step for e in evals] == [0, 10, 20] and evals[0].extra["rows"] == "16"
    assert not (run_dir / "holdout.json").exists()  # nothing held out of the training store
    state = load_checkpoint(list_checkpoints(run_dir)[-1][1])
    assert "excluded" not in state["sampler"]["config"]

    bad = write_config(
        tmp_path / "bad.toml",
        tiny_assets,
        eval={"holdout_store": "missing", "every_steps": 10},
    )
    out = run_cli(bad, tmp_path / "bad")
    errors = [x for x in out.stdout.splitlines() if x.startswith("ERROR:")]
    assert out.returncode == 2 and len(errors) == 1
    assert errors[0].startswith(f"ERROR: eval.holdout_store: {tmp_path / 'missing'}")


@pytest.mark.timeout(240)
def test_a_fresh_run_without_eval_shows_none_of_the_last_runs_figures(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """run-state.json is rewritten over the last run's: its eval and best must not show as
    this run's once `--fresh` archived the checkpoints (best.pt with them) or eval is off."""
    keep = {"checkpoint": {"every_steps": 20, "every_minutes": 60.0, "keep_last": 1}}
    first = write_config(
        tmp_path / "a.toml", tiny_assets, schedule={"max_steps": 20}, eval=EVAL, **keep
    )
    run_dir = tmp_path / "run"
    assert run_cli(first, run_dir).returncode == 0
    before = json.loads((run_dir / "run-state.json").read_text())
    assert before["last_eval"] is not None and before["best_step"] is not None

    plain = write_config(tmp_path / "b.toml", tiny_assets, schedule={"max_steps": 20}, **keep)
    out = run_cli(plain, run_dir, "--fresh")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    after = json.loads((run_dir / "run-state.json").read_text())
    assert after["state"] == "finished"
    stale = ["last_eval", "eval_share", "best_step", "best_tau", "best_checkpoint"]
    assert {k: after[k] for k in stale} == dict.fromkeys(stale)
