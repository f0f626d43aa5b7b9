"""The real pipeline through `python -m trainer` on CPU with the tiny target."""

from __future__ import annotations

import json
import signal
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests import budget
from trainer.events import (
    CheckpointEvent,
    ErrorEvent,
    PhaseEvent,
    RawLine,
    StatusEvent,
    format_line,
    parse_line,
)
from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

from .conftest import REPO, RunCli, cli_env, trainer_argv, write_config


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _events(run_dir: Path) -> list[Any]:
    return [parse_line(x) for x in (run_dir / "status.log").read_text().splitlines()]


@pytest.mark.timeout(180)
def test_trains_hundreds_of_steps_with_parseable_status_and_falling_loss(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """A few hundred steps: every line the trainer printed parses and round-trips; loss falls."""
    cfg = write_config(tmp_path / "run.toml", tiny_assets, schedule={"max_steps": 200})
    out = run_cli(cfg, tmp_path / "run")
    assert out.returncode == 0, out.stderr[-3000:]
    lines = (tmp_path / "run" / "status.log").read_text().splitlines()
    events = [parse_line(x) for x in lines]
    assert not [e for e in events if isinstance(e, RawLine | ErrorEvent)], lines
    assert all(format_line(e) == x for e, x in zip(events, lines, strict=True))
    phases = [e.phase for e in events if isinstance(e, PhaseEvent)]
    assert phases[:3] == ["loading", "starting", "running"] and phases[-1] == "finished"
    status = [e for e in events if isinstance(e, StatusEvent)]
    assert len(status) >= 3
    assert status[0].step == 0 and status[0].lr is None and status[0].loss is None
    assert [s.step for s in status] == sorted(s.step for s in status)
    assert status[-1].step == 200 and all(len(s.q_pre) == 4 and len(s.q_hs) == 1 for s in status)
    assert any(s.ktok_s and s.ktok_s > 0 and s.eta_s is not None for s in status)
    assert any({"w_dft_in", "w_tgt_in", "bottleneck"} <= s.extra.keys() for s in status)
    ckpts = [e for e in events if isinstance(e, CheckpointEvent)]
    assert ckpts[-1].step == 200 and Path(ckpts[-1].path).is_file()
    losses = _losses(tmp_path / "run")
    assert sorted(losses) == list(range(1, 201))
    first = sum(losses[s] for s in range(1, 26)) / 25
    last = sum(losses[s] for s in range(176, 201)) / 25
    assert last < first - 0.4, (first, last)
    state = json.loads((tmp_path / "run" / "run-state.json").read_text())
    assert state["state"] == "finished" and state["exit_status"] == 0 and state["last_step"] == 200
    assert state["end_step"] == 200 and state["total_steps"] > 200 and state["warmup_steps"] >= 1
    assert len(state["boundaries"]) == 5  # the planned edges of the 4 buckets
    assert (tmp_path / "run" / "export" / "config.json").is_file()  # max_steps ends it: exported


@pytest.mark.timeout(240)
def test_resume_reproduces_the_uninterrupted_loss_sequence(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """Resume from step 20 of a run (--resume PATH): steps 21..40 equal the run bit for bit."""
    whole = write_config(
        tmp_path / "whole.toml",
        tiny_assets,
        schedule={"max_steps": 40},
        checkpoint={"every_steps": 20},
    )
    a = run_cli(whole, tmp_path / "a")
    assert a.returncode == 0, a.stderr[-3000:]
    mid = tmp_path / "a" / "checkpoints" / "step-00000020.pt"
    b = run_cli(whole, tmp_path / "b", "--resume", str(mid))
    assert b.returncode == 0, b.stderr[-3000:]
    assert (
        f"Resuming from checkpoint: step=20 path={mid}"
        in (tmp_path / "b" / "status.log").read_text()
    )
    la, lb = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert sorted(lb) == list(range(21, 41))
    assert [lb[s] for s in range(21, 41)] == [la[s] for s in range(21, 41)]
    sa = load_checkpoint(list_checkpoints(tmp_path / "a")[-1][1])
    sb = load_checkpoint(list_checkpoints(tmp_path / "b")[-1][1])
    assert all((sa["drafter"][k] == sb["drafter"][k]).all() for k in sa["drafter"])

    # A resume-critical change is refused with the key named; --fresh archives and restarts.
    changed = write_config(
        tmp_path / "changed.toml",
        tiny_assets,
        batching={"boundaries": [1, 40, 161], "strategy": "bucketed"},
        schedule={"max_steps": 3},
    )
    refused = run_cli(changed, tmp_path / "b")
    assert refused.returncode == 2
    assert "batching.boundaries" in refused.stdout and "--fresh" in refused.stdout
    assert [s for s, _ in list_checkpoints(tmp_path / "b")][-1] == 40  # nothing lost
    fresh = run_cli(changed, tmp_path / "b", "--fresh")
    assert fresh.returncode == 0, fresh.stderr[-3000:]
    old = list((tmp_path / "b").glob("checkpoints.old-*"))
    assert len(old) == 1 and (old[0] / "step-00000040.pt").is_file()
    assert [s for s, _ in list_checkpoints(tmp_path / "b")] == [3]


@pytest.mark.timeout(120)
def test_sigterm_leaves_a_loadable_checkpoint(tmp_path: Path, tiny_assets: dict[str, Any]) -> None:
    """SIGTERM mid-run: the drafter finishes its step, checkpoints, and the process exits 0."""
    cfg = write_config(tmp_path / "run.toml", tiny_assets)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        trainer_argv(cfg, run_dir),
        cwd=REPO,
        env=cli_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        log = run_dir / "status.log"

        def at_step_5() -> bool:
            assert proc.poll() is None, proc.communicate()
            events = [parse_line(x) for x in log.read_text().splitlines()] if log.exists() else []
            return any(isinstance(e, StatusEvent) and e.step >= 5 for e in events)

        budget.until(at_step_5, "the trainer at step 5", every=0.2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=budget.left())
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    events = _events(run_dir)
    stops = [e for e in events if isinstance(e, PhaseEvent) and e.phase == "stopping"]
    assert stops and stops[0].detail == "(SIGTERM)"
    ckpt = [e for e in events if isinstance(e, CheckpointEvent)][-1]
    # The announcement precedes the stop's checkpoint even when the drafter beats the monitor.
    assert events.index(stops[0]) < events.index(ckpt)
    state = load_checkpoint(Path(ckpt.path))
    assert state["step"] == ckpt.step >= 5
    assert state["sampler"]["position"] > 0 and "anchor" in state["rng"][0]
    assert json.loads((run_dir / "run-state.json").read_text())["state"] == "stopped"


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", ["prefetch", "target", "drafter", "monitor"])
def test_failure_in_any_stage_stops_everything_with_traceback(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli, stage: str
) -> None:
    """An exception in any stage exits 1 promptly (no hang), traceback on stderr, ERROR line."""
    cfg = write_config(tmp_path / "run.toml", tiny_assets)
    out = run_cli(cfg, tmp_path / "run", env=cli_env(DFLASH_FAULT=f"{stage}:3"))
    assert out.returncode == 1, out.stderr[-3000:]
    assert "Traceback (most recent call last)" in out.stderr
    assert "InjectedFault" in out.stderr
    last = _events(tmp_path / "run")[-1]
    assert isinstance(last, ErrorEvent) and f"stage {stage}" in last.message
    state = json.loads((tmp_path / "run" / "run-state.json").read_text())
    assert state["state"] == "crashed" and state["exit_status"] == 1


@pytest.mark.timeout(60)
def test_bad_config_is_one_line_and_exit_2(tmp_path: Path, run_cli: RunCli) -> None:
    """A typo in the config names the file and key, and nothing starts."""
    bad = tmp_path / "bad.toml"
    bad.write_text(
        (REPO / "configs" / "tiny-cpu.toml").read_text() + "\n[optimizer.extra]\nx = 1\n"
    )
    out = run_cli(bad, tmp_path / "run")
    assert out.returncode == 2
    assert out.stdout.strip().splitlines() == [
        f"ERROR: {bad}: optimizer.extra: unknown key (typo?)"
    ]


@pytest.mark.timeout(90)
def test_nonfinite_losses_are_skipped_then_stop_the_run(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """NaN losses skip the update (weights stay finite); N in a row stop with a clear error."""
    cfg = write_config(tmp_path / "run.toml", tiny_assets, optimizer={"max_nonfinite": 3})
    out = run_cli(cfg, tmp_path / "run", env=cli_env(DFLASH_NONFINITE="4:2,9:100"))
    assert out.returncode == 1, out.stderr[-3000:]
    losses = _losses(tmp_path / "run")
    assert [s for s, v in losses.items() if v != v] == [5, 6, 10, 11]  # NaN != NaN; 12 raised
    assert all(losses[s] == losses[s] for s in (1, 2, 3, 4, 7, 8, 9))
    last = _events(tmp_path / "run")[-1]
    assert isinstance(last, ErrorEvent)
    assert "NonFiniteLoss: 3 non-finite losses in a row (step 12)" in last.message


@pytest.mark.timeout(60)
def test_non_utf8_config_is_one_line_with_the_byte_offset_and_exit_2(
    tmp_path: Path, run_cli: RunCli
) -> None:
    """A config saved in Latin-1 names the file and the first bad byte; no traceback."""
    bad = tmp_path / "latin1.toml"
    text = (REPO / "configs" / "tiny-cpu.toml").read_bytes()
    bad.write_bytes(text + b"# r\xe9sum\xe9\n")
    out = run_cli(bad, tmp_path / "run")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    line = text.count(b"\n") + 1
    assert out.stdout.strip().splitlines() == [
        f"ERROR: {bad}: not UTF-8 text at byte {len(text) + 3} (line {line}): "
        "invalid continuation byte 0xe9"
    ]
    assert not (tmp_path / "run").exists()  # refused before anything was created


def test_a_sample_over_the_budget_names_its_input_line(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """The sampler's `sample N` refusal is traced to the import's input line (lines.i64)."""
    from trainer.data.store import StoreWriter, TokenStore

    src = TokenStore.open(tiny_assets["data"]["store"])
    longest = int(np.argmax(src.lengths))
    with StoreWriter(tmp_path / "store") as writer:
        for i in range(len(src)):
            tokens, mask = src.row(i)
            writer.add(tokens, mask, source_line=10 * i + 3)
        keep = {"kind", "source", "vocab_size", "max_length", "reserved_token_ids"}
        writer.commit(**src.manifest.model_dump(include=keep | {"mask_token_id", "mask_strategy"}))
    budget = int(src.lengths[longest]) - 1
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        data={"store": str(tmp_path / "store")},
        batching={"token_budget": budget},
    )
    out = run_cli(cfg, tmp_path / "run")
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"sample {longest} (input line {10 * longest + 3})" in out.stdout, out.stdout
