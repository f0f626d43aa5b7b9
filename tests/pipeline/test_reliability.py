"""The trainer under faults, for real: damaged checkpoints, a diverging LR, a full disk,
a corrupted run-state file and signals in quick succession (CPU, tiny target)."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from tests import budget
from tests.conftest import tmpfs
from trainer.events import CheckpointEvent, ErrorEvent, PhaseEvent, StatusEvent, parse_line
from trainer.pipeline.checkpoint import list_checkpoints, load_checkpoint

from .conftest import REPO, RunCli, cli_env, trainer_argv, write_config


def _losses(run_dir: Path) -> dict[int, float]:
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows}


def _events(run_dir: Path) -> list[Any]:
    return [parse_line(x) for x in (run_dir / "status.log").read_text().splitlines()]


def _errors(run_dir: Path) -> list[str]:
    return [e.message for e in _events(run_dir) if isinstance(e, ErrorEvent)]


def _run_state(run_dir: Path) -> dict[str, Any]:
    state: dict[str, Any] = json.loads((run_dir / "run-state.json").read_text())
    return state


def _steps(run_dir: Path) -> list[int]:
    return [s for s, _ in list_checkpoints(run_dir)]


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _stdout_errors(out: subprocess.CompletedProcess[str]) -> list[str]:
    return [x for x in out.stdout.splitlines() if x.startswith("ERROR: ")]


@pytest.mark.timeout(300)
def test_resume_falls_back_past_truncated_and_non_finite_checkpoints(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """A truncated newest checkpoint exited 2 although an older one was intact: now each bad
    one is named, moved aside (kept), and the run resumes from the newest good one bit for bit.
    An explicit --resume of a bad one (PATH or STEP) stays a one-line refusal, exit 2."""
    run_dir = tmp_path / "run"
    cfg = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": 30},
        checkpoint={"every_steps": 10},
    )
    first = run_cli(cfg, run_dir)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _steps(run_dir) == [10, 20, 30]
    whole = _losses(run_dir)
    ck = run_dir / "checkpoints"
    # step 30: cut in half (a copy interrupted, a disk error); step 20: NaN in one weight (as the
    # old trainer wrote after `lr = inf`).
    data = (ck / "step-00000030.pt").read_bytes()
    (ck / "step-00000030.pt").write_bytes(data[: len(data) // 2])
    state = torch.load(ck / "step-00000020.pt", weights_only=False)
    name = next(iter(state["drafter"]))
    state["drafter"][name].view(-1)[0] = float("nan")
    torch.save(state, ck / "step-00000020.pt")
    before = {p.name: _sha(p) for p in ck.iterdir()}

    longer = write_config(
        tmp_path / "run.toml",
        tiny_assets,
        schedule={"max_steps": 40},
        checkpoint={"every_steps": 10},
    )
    for arg, why in (
        ("30", r"step-00000030\.pt: cannot load checkpoint \(truncated\?\): "),
        (str(ck / "step-00000020.pt"), rf"step-00000020\.pt: non-finite values in drafter\.{name}"),
        ("7", r"step-00000007\.pt: no checkpoint for step 7 \(steps here: 10, 20, 30\)"),
    ):
        refused = run_cli(longer, run_dir, "--resume", arg)
        assert refused.returncode == 2, refused.stdout + refused.stderr[-2000:]
        errors = _stdout_errors(refused)
        assert len(errors) == 1 and re.search(why, errors[0]), refused.stdout
        assert "Traceback" not in refused.stderr
        assert {p.name: _sha(p) for p in ck.iterdir()} == before  # nothing moved or deleted
        assert _run_state(run_dir)["state"] == "refused"

    resumed = run_cli(longer, run_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    errors = _errors(run_dir)
    assert any(
        m.startswith(f"skipped checkpoint {ck / 'step-00000030.pt'}: cannot load checkpoint")
        and m.endswith(f"moved to {ck / 'rejected' / 'step-00000030.pt'}")
        for m in errors
    ), errors
    assert any(
        m.startswith(f"skipped checkpoint {ck / 'step-00000020.pt'}: non-finite values in drafter")
        for m in errors
    ), errors
    phases = [e for e in _events(run_dir) if isinstance(e, PhaseEvent) and e.phase == "resuming"]
    assert phases[-1].detail == (
        f"step=10 path={ck / 'step-00000010.pt'} skipped=step-00000030.pt,step-00000020.pt"
    )
    # Kept byte for byte, with the reason beside each.
    rejected = ck / "rejected"
    assert _sha(rejected / "step-00000030.pt") == before["step-00000030.pt"]
    assert _sha(rejected / "step-00000020.pt") == before["step-00000020.pt"]
    assert (rejected / "step-00000020.pt.why").read_text().startswith("non-finite values in ")
    # The resumed run repeats steps 11..30 exactly and its new checkpoints replaced nothing good.
    again = _losses(run_dir)
    assert [again[s] for s in range(11, 31)] == [whole[s] for s in range(11, 31)]
    assert _steps(run_dir) == [20, 30, 40]
    assert all(load_checkpoint(p)["step"] == s for s, p in list_checkpoints(run_dir))


@pytest.mark.timeout(240)
def test_an_inf_lr_step_never_writes_a_poisoned_checkpoint(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """One AdamW update with lr = inf (what `optimizer.lr = inf` did before the config refused
    it; DFLASH_INF_LR) turns every weight into NaN/inf: the next checkpoint is refused in one
    line, the good one stays (keep_last = 1 rotates nothing out), and a resume carries on."""
    run_dir = tmp_path / "run"
    ckpt = {"every_steps": 5, "keep_last": 1}
    cfg = write_config(
        tmp_path / "run.toml", tiny_assets, schedule={"max_steps": 10}, checkpoint=ckpt
    )
    assert run_cli(cfg, run_dir).returncode == 0
    kept = run_dir / "checkpoints" / "step-00000010.pt"
    digest = _sha(kept)
    cfg = write_config(
        tmp_path / "run.toml", tiny_assets, schedule={"max_steps": 30}, checkpoint=ckpt
    )
    out = run_cli(cfg, run_dir, env=cli_env(DFLASH_INF_LR="10"))  # the first resumed step
    assert out.returncode == 1, out.stderr[-3000:]
    last = _events(run_dir)[-1]
    assert isinstance(last, ErrorEvent)
    assert re.fullmatch(
        r"stage drafter failed: NonFiniteState: step 15: checkpoint step-00000015\.pt not "
        r"written: non-finite values in drafter\.\S+, drafter\.\S+ \(\+\d+ more\); kept "
        r"step-00000010\.pt; the run diverged: lower optimizer\.lr and resume",
        last.message,
    ), last.message
    assert "Traceback" not in out.stderr  # explained, not a crash dump
    assert _steps(run_dir) == [10] and _sha(kept) == digest
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == [kept.name]
    state = _run_state(run_dir)
    assert state["state"] == "crashed" and state["last_checkpoint"] == str(kept)
    assert state["lost_steps"] == 5
    assert state["last_error"] == last.message
    after = run_cli(cfg, run_dir)
    assert after.returncode == 0, after.stderr[-3000:]
    assert f"Resuming from checkpoint: step=10 path={kept}" in after.stdout
    final = load_checkpoint(list_checkpoints(run_dir)[-1][1])
    assert final["step"] == 30 and all(t.isfinite().all() for t in final["drafter"].values())


def _fill(disk: Path, leave: int) -> Path:
    """Write a new filler file until only `leave` bytes remain (real blocks, not sparse)."""
    filler = disk / f"filler-{len(list(disk.glob('filler-*')))}"
    st = os.statvfs(disk)
    todo = st.f_bavail * st.f_frsize - leave
    chunk = b"\0" * (1 << 20)
    with open(filler, "wb") as fh:
        while todo > 0:
            todo -= fh.write(chunk[: min(len(chunk), todo)])
    return filler


@pytest.mark.timeout(240)
def test_a_full_disk_fails_the_checkpoint_in_one_line_and_loses_nothing(
    tmp_path: Path, tiny_assets: dict[str, Any], run_cli: RunCli
) -> None:
    """On a real full filesystem (a small tmpfs): the checkpoint write gets ENOSPC from the
    kernel; the trainer says how much space there is and needs, removes its temp file, keeps
    training to its end, leaves the previous checkpoint loadable and run-state.json true."""
    with tmpfs(tmp_path / "disk", "24m") as disk:
        run_dir = disk / "run"
        ckpt = {"every_steps": 5, "keep_last": 3}
        cfg = write_config(
            tmp_path / "a.toml", tiny_assets, schedule={"max_steps": 10}, checkpoint=ckpt
        )
        assert run_cli(cfg, run_dir).returncode == 0
        kept = run_dir / "checkpoints" / "step-00000010.pt"
        digest, size = _sha(kept), kept.stat().st_size
        filler = _fill(disk, leave=size // 3)  # room for the logs, not for a checkpoint

        cfg = write_config(
            tmp_path / "b.toml", tiny_assets, schedule={"max_steps": 20}, checkpoint=ckpt
        )
        out = run_cli(cfg, run_dir)
        assert out.returncode == 1, out.stderr[-3000:]
        assert "Traceback" not in out.stderr and "unexpected pos" not in out.stdout + out.stderr
        errors = _stdout_errors(out)
        pattern = (
            rf"ERROR: checkpoint step=(15|20) not written to "
            rf"{re.escape(str(run_dir / 'checkpoints'))}: no space left \((\d+\.\d) MiB free, "
            rf"checkpoint needs (\d+\.\d)\); kept step-00000010\.pt"
        )
        full = [m for m in errors if re.fullmatch(pattern, m)]
        assert [re.fullmatch(pattern, m).group(1) for m in full] == ["15", "20"], errors  # type: ignore[union-attr]
        free, needs = (float(x) for x in re.fullmatch(pattern, full[0]).groups()[1:])  # type: ignore[union-attr]
        assert free < needs and needs >= size / 2**20 * 0.9
        assert errors[-1] == (
            "ERROR: stopped at step 20 without its checkpoint: resuming from step-00000010.pt "
            "repeats 10 step(s)"
        )
        # No temp file anywhere; the old checkpoint intact; run-state says what happened.
        leftovers = [p for p in run_dir.rglob(".*") if p.is_file()]
        assert leftovers == [], leftovers
        assert _steps(run_dir) == [5, 10] and _sha(kept) == digest
        assert load_checkpoint(kept)["step"] == 10
        state = _run_state(run_dir)
        assert state["state"] == "crashed" and state["exit_status"] == 1, state
        assert state["last_checkpoint"] == str(kept) and state["lost_steps"] == 10
        assert state["checkpoint_error"] == errors[-2].removeprefix("ERROR: ")
        assert state["checkpoint_failed"]["step"] == 20 and state["checkpoint_failures"] == 2
        assert "ERROR: " + state["last_error"] == errors[-1]
        assert state["pid"] and state["config_hash"] and state["release"]

        # Not one byte left: the logs cannot grow and run-state.json cannot be replaced by a
        # temp file (it is rewritten in place), yet the run still ends saying what happened.
        brim = _fill(disk, leave=0)
        brim_cfg = write_config(
            tmp_path / "c.toml", tiny_assets, schedule={"max_steps": 12}, checkpoint=ckpt
        )
        out = run_cli(brim_cfg, run_dir)
        assert out.returncode == 1, out.stderr[-3000:]
        assert "Traceback" not in out.stderr
        assert any(re.fullmatch(pattern.replace("(15|20)", "12"), m) for m in _stdout_errors(out))
        assert [p for p in run_dir.rglob(".*") if p.is_file()] == []
        state = _run_state(run_dir)
        assert state["state"] == "crashed" and state["config_hash"] and state["release"]
        assert state["last_checkpoint"] == str(kept) and state["lost_steps"] == 2
        assert _sha(kept) == digest
        brim.unlink()

        filler.unlink()  # the operator frees space: the run resumes from the kept checkpoint
        again = run_cli(cfg, run_dir)
        assert again.returncode == 0, again.stderr[-3000:]
        assert f"Resuming from checkpoint: step=10 path={kept}" in again.stdout
        assert _run_state(run_dir)["state"] == "finished" and _steps(run_dir)[-1] == 20


def _start(cfg: Path, run_dir: Path, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        trainer_argv(cfg, run_dir),
        cwd=REPO,
        env=cli_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _wait_for_step(proc: subprocess.Popen[str], run_dir: Path, step: int) -> None:
    log = run_dir / "status.log"

    def reached() -> bool:
        assert proc.poll() is None, f"trainer exited ({proc.poll()}) before step {step}"
        events = [parse_line(x) for x in log.read_text().splitlines()] if log.exists() else []
        return any(isinstance(e, StatusEvent) and e.step >= step for e in events)

    budget.until(reached, f"the trainer at step {step}", every=0.1)


def _last_metric_step(run_dir: Path) -> int:
    return max(_losses(run_dir))


@pytest.mark.timeout(180)
def test_two_sigints_half_a_second_apart_end_stopped_with_a_checkpoint(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    """run-state.json corrupted mid-run is rewritten whole within a status interval; then
    Ctrl-C twice, 0.5 s apart: exit 0 (not 130), a checkpoint of the last step, and run-state
    `stopped` with the signal's name and every field the trainer owns."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", tiny_assets)
    proc = _start(cfg, run_dir)
    try:
        _wait_for_step(proc, run_dir, 5)
        (run_dir / "run-state.json").write_text('{"state": "running", "pid": ')  # torn write

        def healed_by_trainer() -> bool:  # the trainer heals it within a status interval
            with contextlib.suppress(ValueError):
                return bool(_run_state(run_dir).get("pid") == proc.pid)
            return False

        budget.until(healed_by_trainer, "run-state.json rewritten by the trainer")
        healed = _run_state(run_dir)
        assert healed["state"] == "running" and len(healed["config_hash"]) == 12
        proc.send_signal(signal.SIGINT)
        time.sleep(0.5)
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=budget.left())
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    state = _run_state(run_dir)
    assert state["state"] == "stopped" and state["exit_status"] == 0
    assert state["stop_signal"] == "SIGINT" and state["lost_steps"] == 0
    assert state["pid"] == proc.pid and len(state["config_hash"]) == 12 and state["release"]
    assert state["started_at"] and state["total_steps"] > 0 and state["world_size"] == 1
    last = _last_metric_step(run_dir)
    assert state["last_step"] == last and _steps(run_dir)[-1] == last
    assert state["last_checkpoint"] == str(run_dir / "checkpoints" / f"step-{last:08d}.pt")
    kept = rf"checkpoint step-{last:08d}\.pt holds step {last}"
    assert re.fullmatch(
        rf"SIGINT: finished step {last} and stopped; {kept}"  # the second one came too late
        # or before the stop was recorded: at least 0.3 s later (a loaded machine: any later)
        rf"(; SIGINT (0\.[3-9]|[1-9]\d*\.\d) s later came after that checkpoint and changed "
        rf"nothing)?|second signal SIGINT \d+\.\d s after SIGINT: .*; {kept}",
        state["stop_detail"],
    ), state["stop_detail"]
    assert any(
        m.startswith(f"{run_dir / 'run-state.json'}: not JSON") and m.endswith("rewritten whole")
        for m in _errors(run_dir)
    )


@pytest.mark.timeout(180)
def test_two_sigints_at_once_keep_the_last_step_and_say_so(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    """Two SIGINTs 50 ms apart while the drafter waits for a slow target lost the steps since
    the last checkpoint and showed as a crash (exit 1) with no word of the signal: now the last
    completed step is checkpointed, the exit is 0 and run-state says what the second one did.
    (Two signals sent with no gap at all can merge into one in the kernel.)"""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", tiny_assets)
    proc = _start(cfg, run_dir, DFLASH_STAGE_DELAY="target:1.0")
    try:
        _wait_for_step(proc, run_dir, 2)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(0.05)
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=budget.left())
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    state = _run_state(run_dir)
    last = _last_metric_step(run_dir)
    assert state["state"] == "stopped" and state["stop_signal"] == "SIGINT"
    assert state["signals"] == 2 and state["lost_steps"] == 0 and state["last_step"] == last
    kept = rf"checkpoint step-{last:08d}\.pt holds step {last}"
    assert re.fullmatch(
        rf"second signal SIGINT \d+\.\d s after SIGINT: stopped at once after step {last}; {kept}"
        # (rarely, the step in flight completes and checkpoints between the two signals)
        rf"|SIGINT: finished step {last} and stopped; {kept}; SIGINT \d+\.\d s later came after "
        "that checkpoint and changed nothing",
        state["stop_detail"],
    ), state["stop_detail"]
    events = _events(run_dir)
    ckpts = [e for e in events if isinstance(e, CheckpointEvent)]
    assert ckpts[-1].step == last and load_checkpoint(Path(ckpts[-1].path))["step"] == last
    details = [e.detail for e in events if isinstance(e, PhaseEvent) and e.phase == "stopping"]
    assert details[0] == "(SIGINT)" and details[-1] == f"done at step {last} (SIGINT)"
    if state["stop_detail"].startswith("second"):
        assert "second SIGINT: stopping at once, no more steps" in details


@pytest.mark.timeout(180)
def test_signals_after_the_stop_is_recorded_cannot_kill_the_exit(
    tmp_path: Path, tiny_assets: dict[str, Any]
) -> None:
    """A Ctrl-C that lands while the stopped trainer exits (interpreter teardown) made the pane
    report exit 130 for a run whose run-state said stopped/0; once recorded, it is ignored."""
    run_dir = tmp_path / "run"
    cfg = write_config(tmp_path / "run.toml", tiny_assets)
    proc = _start(cfg, run_dir)
    try:
        _wait_for_step(proc, run_dir, 5)
        proc.send_signal(signal.SIGINT)
        while proc.poll() is None:  # keep pressing Ctrl-C from the stop's record to the exit
            with contextlib.suppress(ValueError, OSError):
                if _run_state(run_dir).get("state") == "stopped":
                    proc.send_signal(signal.SIGINT)
            time.sleep(0.002)
        _, err = proc.communicate(timeout=budget.left())
    finally:
        proc.kill()
    assert proc.returncode == 0, err[-3000:]
    state = _run_state(run_dir)
    assert state["state"] == "stopped" and state["exit_status"] == 0 and state["lost_steps"] == 0


def test_run_state_is_rewritten_in_place_on_a_full_disk(tmp_path: Path) -> None:
    """With not one byte free the temp file cannot be written: the state is rewritten in place
    (truncation frees the old blocks) rather than left saying `running`, and no temp remains."""
    from trainer.pipeline.status import RunStateFile

    with tmpfs(tmp_path / "disk", "1m") as disk:
        rs = RunStateFile(disk)
        assert rs.update(pid=1, state="running", config_hash="abc") == []
        _fill(disk, leave=0)
        with pytest.raises(OSError, match="No space left"):
            (disk / "probe").write_text("x")
        assert rs.update(state="crashed", exit_status=1) == []
        state = _run_state(disk)
        assert (state["state"], state["exit_status"], state["config_hash"]) == ("crashed", 1, "abc")
        assert sorted(p.name for p in disk.iterdir()) == ["filler-0", "probe", "run-state.json"]
