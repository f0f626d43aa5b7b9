"""Trackers through the real libraries, read back with their own readers (issue 13 item 5)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.tracking.conftest import wandb_history, wandb_records, wandb_run_files
from trainer.config import TrackingConfig, TrainConfig, resume_critical_changes
from trainer.events import EvalEvent, StatusEvent, parse_line
from trainer.tracking import (
    WANDB_ID_FILE,
    eval_scalars,
    event_scalars,
    log_event,
    open_trackers,
    read_wandb_key,
    resolve_wandb_mode,
    status_scalars,
)

STATUS = (
    "[12m] step={step} loss={loss:.4f} acc=0.613 streak=2.4 lr=5.90e-04 noise=0.0000 |"
    " tgt=3.10b/s dft=3.05b/s (8.2Ktok/s) | q_pre=[4, 4, 3] q_hs=[2] | epoch~0.41 ETA=1.2h"
    " | w_pre_out=0.0% w_tgt_in=1.2% w_tgt_out=30.5% w_dft_in=2.1% bottleneck=drafter"
    " gnorm=0.812 tau=3.214 loss_b=[1.9021,---,0.8123]"
)
EVAL = (
    "Eval: step={step} tau={tau:.3f} loss=1.2345 acc=0.613 acc@1=0.912 acc@2=0.801"
    " tau_exp=3.368 best={step} | rows=256 share=2.3%"
)


def _events(steps: range) -> list[StatusEvent | EvalEvent]:
    """Status lines every step, an eval line every other step, parsed from their real text."""
    out: list[StatusEvent | EvalEvent] = []
    for s in steps:
        lines = [STATUS.format(step=s, loss=4.0 / (s + 1))]
        if s % 2 == 0:
            lines.append(EVAL.format(step=s, tau=1.0 + s / 10))
        for line in lines:
            event = parse_line(line)
            assert isinstance(event, StatusEvent | EvalEvent)
            out.append(event)
    return out


def _expected(events: list[StatusEvent | EvalEvent]) -> dict[str, dict[int, float]]:
    """tag -> step -> value, as the trackers should have recorded them."""
    out: dict[str, dict[int, float]] = {}
    for ev in events:
        step, scalars = event_scalars(ev)  # type: ignore[misc]
        for tag, value in scalars.items():
            out.setdefault(tag, {})[step] = value
    return out


def _tb_read(tb_dir: Path) -> dict[str, dict[int, float]]:
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    out = {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()["scalars"]}
    assert all(len(out[t]) == len(acc.Scalars(t)) for t in out), "a step was logged twice"
    return out


def _wandb_by_tag(run_file: Path) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for step, item in wandb_history(run_file).items():
        for tag, value in item.items():
            out.setdefault(tag, {})[step] = value
    return out


def _assert_same(
    got: dict[str, dict[int, float]], want: dict[str, dict[int, float]], rel: float
) -> None:
    assert set(got) == set(want)
    for tag in want:
        assert sorted(got[tag]) == sorted(want[tag]), tag
        assert got[tag] == pytest.approx(want[tag], rel=rel), tag


# --------------------------------------------------------------------------- mapping


def test_status_scalars_carry_every_figure_of_the_line() -> None:
    ev = parse_line(STATUS.format(step=7, loss=1.5))
    assert isinstance(ev, StatusEvent)
    assert status_scalars(ev) == pytest.approx(
        {
            "train/loss": 1.5,
            "train/acc": 0.613,
            "train/streak": 2.4,
            "train/lr": 5.9e-4,
            "train/epoch": 0.41,
            "speed/ktok_s": 8.2,
            "speed/tgt_batches_s": 3.10,
            "speed/dft_batches_s": 3.05,
            "train/gnorm": 0.812,
            "wait/w_pre_out": 0.0,
            "wait/w_tgt_in": 1.2,
            "wait/w_tgt_out": 30.5,
            "wait/w_dft_in": 2.1,
            "train/loss_b0": 1.9021,
            "train/loss_b2": 0.8123,  # bucket 1 had no batch in the interval: not a zero
            "queue/q_pre0": 4.0,
            "queue/q_pre1": 4.0,
            "queue/q_pre2": 3.0,
            "queue/q_hs0": 2.0,
        }
    )


def test_nonfinite_count_is_logged_when_the_line_carries_it() -> None:
    ev = parse_line(STATUS.format(step=7, loss=1.5) + " nonfinite=3")
    assert isinstance(ev, StatusEvent)
    assert status_scalars(ev)["train/nonfinite"] == 3.0
    plain = parse_line(STATUS.format(step=7, loss=1.5))
    assert isinstance(plain, StatusEvent)
    assert "train/nonfinite" not in status_scalars(plain)


def test_missing_fields_are_left_out_not_zero() -> None:
    ev = parse_line(
        "[0m] step=0 loss=--- acc=--- streak=--- lr=--- noise=0.1000 | tgt=0.00b/s"
        " dft=0.00b/s (0.0Ktok/s) | q_pre=[4] q_hs=[0] | epoch~0.00 ETA=???"
    )
    assert isinstance(ev, StatusEvent)
    assert set(status_scalars(ev)) == {
        "queue/q_pre0",
        "queue/q_hs0",
        "speed/ktok_s",
        "speed/tgt_batches_s",
        "speed/dft_batches_s",
        "train/epoch",
    }


def test_eval_scalars() -> None:
    ev = parse_line(EVAL.format(step=4, tau=3.5))
    assert isinstance(ev, EvalEvent)
    assert eval_scalars(ev) == pytest.approx(
        {
            "eval/tau": 3.5,
            "eval/tau_exp": 3.368,
            "eval/loss": 1.2345,
            "eval/acc": 0.613,
            "eval/acc@1": 0.912,
            "eval/acc@2": 0.801,
            "eval/best_step": 4.0,
            "eval/rows": 256.0,
            "eval/share": 2.3,
        }
    )
    assert event_scalars(parse_line("Training finished.")) is None


# --------------------------------------------------------------------------- backends


def test_tensorboard_event_files_read_back_with_tensorboards_reader(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    warnings: list[str] = []
    tracker = open_trackers(
        TrackingConfig(backends=["tensorboard"]),
        run,
        warn=warnings.append,
        notes={"loss": "ce+kd(0.5)"},
    )
    assert tracker.names == ["tensorboard"]
    events = _events(range(0, 60, 3))
    for ev in events:
        log_event(tracker, ev)
    tracker.close()
    assert warnings == []
    got = _tb_read(run / "tb")
    _assert_same(got, _expected(events), rel=1e-6)  # TensorBoard stores float32
    assert len(got["train/loss"]) == 20 and len(got["eval/tau"]) == 10
    acc = EventAccumulator(str(run / "tb"), size_guidance={"tensors": 0})
    acc.Reload()  # which loss ran: one text summary
    (note,) = acc.Tensors("run/loss/text_summary")
    assert note.tensor_proto.string_val[0].decode() == "ce+kd(0.5)"


def test_a_resumed_run_replaces_the_re_trained_steps_in_tensorboard(tmp_path: Path) -> None:
    """Resumed from step 3 after logging 0..5: TensorBoard shows 0..7 once, 3..5 as re-trained."""
    run = tmp_path / "run"
    run.mkdir()
    cfg = TrackingConfig(backends=["tensorboard"])
    first = open_trackers(cfg, run)
    for s in range(6):
        first.log_scalars(s, {"train/loss": 10.0 + s})
    first.close()
    second = open_trackers(cfg, run, resume_step=3)
    for s in range(3, 8):
        second.log_scalars(s, {"train/loss": 20.0 + s})
    second.close()
    acc = EventAccumulator(str(run / "tb"))
    acc.Reload()
    points = [(e.step, e.value) for e in acc.Scalars("train/loss")]
    assert points == [(0, 10.0), (1, 11.0), (2, 12.0), *((s, 20.0 + s) for s in range(3, 8))]


def test_wandb_offline_run_reads_back_with_wandbs_reader(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    warnings: list[str] = []
    tracker = open_trackers(
        TrackingConfig(backends=["wandb"], wandb_project="proj"),
        run,
        name="tiny",
        config={"seed": 3},
        notes={"loss": "dpace(alpha:0.5)"},
        warn=warnings.append,
    )
    assert tracker.names == ["wandb"]
    events = _events(range(0, 30, 3))
    for ev in events:
        log_event(tracker, ev)
    tracker.close()
    assert warnings == []
    files = wandb_run_files(run)
    assert len(files) == 1  # under RUN/wandb/, not $WANDB_DIR
    _assert_same(_wandb_by_tag(files[0]), _expected(events), rel=1e-12)
    head = next(r["run"] for r in wandb_records(files[0]) if r["type"] == "run")
    assert head["run_id"] == (run / WANDB_ID_FILE).read_text().strip()
    assert head["project"] == "proj"
    config = head["config"]["update"]  # the run config, and which loss ran, beside it
    assert config["seed"] == 3 and config["loss"] == "dpace(alpha:0.5)"


def test_resumed_run_continues_the_same_wandb_run(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    cfg = TrackingConfig(backends=["wandb"])
    first = open_trackers(cfg, run)
    for ev in _events(range(0, 4)):
        log_event(first, ev)
    first.close()
    run_id = (run / WANDB_ID_FILE).read_text().strip()
    second = open_trackers(cfg, run)  # the resumed process
    for ev in _events(range(4, 8)):
        log_event(second, ev)
    second.close()
    files = wandb_run_files(run)
    assert len(files) == 2
    heads = [next(r["run"] for r in wandb_records(f) if r["type"] == "run") for f in files]
    assert [h["run_id"] for h in heads] == [run_id, run_id]
    assert all(h.get("resume") for h in heads)
    assert sorted(wandb_history(files[1])) == [4, 5, 6, 7]
    # a fresh run directory gets its own id
    other = tmp_path / "other"
    other.mkdir()
    open_trackers(cfg, other).close()
    assert (other / WANDB_ID_FILE).read_text().strip() != run_id


def test_a_backend_that_cannot_start_warns_once_and_the_other_logs(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "tb").write_text("not a directory\n")
    warnings: list[str] = []
    tracker = open_trackers(
        TrackingConfig(backends=["tensorboard", "wandb"]), run, warn=warnings.append
    )
    assert tracker.names == ["wandb"]
    events = _events(range(0, 10))
    for ev in events:
        log_event(tracker, ev)
    tracker.close()
    assert len(warnings) == 1 and "\n" not in warnings[0]
    assert warnings[0].startswith("tracking: tensorboard could not start")
    assert "tb" in warnings[0] and ("Exists" in warnings[0] or "Directory" in warnings[0])
    _assert_same(_wandb_by_tag(wandb_run_files(run)[0]), _expected(events), rel=1e-12)


def test_a_backend_failing_mid_run_warns_once_and_the_other_keeps_logging(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    warnings: list[str] = []
    tracker = open_trackers(
        TrackingConfig(backends=["wandb", "tensorboard"]), run, warn=warnings.append
    )
    events = _events(range(0, 12))
    for ev in events[:4]:
        log_event(tracker, ev)
    # The W&B run ends under the tracker (as when wandb's service dies): its next log raises.
    wandb_guard = tracker.trackers[0]
    wandb_guard._inner._run.finish()  # type: ignore[union-attr]
    for ev in events[4:]:
        log_event(tracker, ev)
    tracker.close()
    assert len(warnings) == 1, warnings
    assert warnings[0].startswith("tracking: wandb logging failed, wandb logging is off")
    assert tracker.names == []  # closed
    _assert_same(_tb_read(run / "tb"), _expected(events), rel=1e-6)  # nothing lost there


def test_no_backends_imports_no_tracker_library(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    code = (
        "import sys; from pathlib import Path\n"
        "from trainer.config import TrackingConfig\n"
        "from trainer.tracking import open_trackers, log_event\n"
        "from trainer.events import parse_line\n"
        f"t = open_trackers(TrackingConfig(), Path({str(run)!r}))\n"
        f"log_event(t, parse_line({STATUS.format(step=1, loss=1.0)!r})); t.close()\n"
        "heavy = [m for m in ('torch', 'wandb', 'tensorboard') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert res.returncode == 0, res.stderr
    assert list(run.iterdir()) == []  # and writes nothing


# --------------------------------------------------------------------------- W&B key and mode


def test_wandb_key_comes_from_the_env_or_dflashctls_secret_file(tmp_path: Path) -> None:
    secrets = tmp_path / "secrets"
    assert read_wandb_key(secrets, {}) is None
    secrets.mkdir()
    (secrets / "wandb").write_text("  k-from-file\n")
    (secrets / "wandb").chmod(0o600)
    assert read_wandb_key(secrets, {}) == "k-from-file"
    assert read_wandb_key(secrets, {"WANDB_API_KEY": "k-env"}) == "k-env"
    (secrets / "wandb").write_text("\n")
    assert read_wandb_key(secrets, {}) is None


def test_auto_mode_is_online_only_with_a_key() -> None:
    assert resolve_wandb_mode("auto", None) == "offline"
    assert resolve_wandb_mode("auto", "k") == "online"
    assert resolve_wandb_mode("offline", "k") == "offline"
    assert resolve_wandb_mode("disabled", "k") == "disabled"


def test_online_start_without_an_answer_warns_once_goes_offline_and_never_shows_the_key(
    tmp_path: Path,
) -> None:
    """WORKDIR/secrets/wandb (dflashctl's secret) makes auto mode online; the server (the conftest's
    discard port) never answers, so the run falls back offline, keeps its metrics, hides the key."""
    workdir = tmp_path / "work"
    run = workdir / "run"
    run.mkdir(parents=True)
    (workdir / "secrets").mkdir()
    key = "0123456789abcdef0123456789abcdef0123beef"
    (workdir / "secrets" / "wandb").write_text(key + "\n")
    warnings: list[str] = []
    tracker = open_trackers(
        TrackingConfig(backends=["wandb"]), run, warn=warnings.append, wandb_init_timeout=3
    )
    assert tracker.names == ["wandb"]
    events = _events(range(0, 6))
    for ev in events:
        log_event(tracker, ev)
    tracker.close()
    assert len(warnings) == 1
    assert warnings[0].startswith("tracking: wandb online start failed")
    assert "logging offline" in warnings[0] and key not in warnings[0]
    _assert_same(_wandb_by_tag(wandb_run_files(run)[0]), _expected(events), rel=1e-12)
    # not in the run's files, nor in $HOME/.netrc or wandb's settings (the sandbox of conftest)
    files = [p for p in tmp_path.rglob("*") if p.is_file() and p.parent.name != "secrets"]
    assert [p for p in files if key.encode() in p.read_bytes()] == []


def test_disabled_wandb_opens_nothing(tmp_path: Path) -> None:
    tracker = open_trackers(TrackingConfig(backends=["wandb"], wandb_mode="disabled"), tmp_path)
    assert tracker.names == []
    assert not (tmp_path / "wandb").exists()


# --------------------------------------------------------------------------- config section

_BASE = {
    "data": {"store": "s"},
    "batching": {"token_budget": 64},
    "model": {"target_dir": "t", "mask_token_id": 1},
}


def test_tracking_section_defaults_and_errors() -> None:
    assert TrainConfig.from_dict(_BASE).tracking == TrackingConfig(backends=[])
    for bad, needle in [
        ({"backends": ["tb"]}, "tracking.backends.0"),
        ({"backends": "wandb"}, "tracking.backends"),
        ({"backends": ["wandb", "wandb"]}, "twice"),
        ({"wandb_mode": "cloud"}, "tracking.wandb_mode"),
        ({"wandb_projct": "x"}, "tracking.wandb_projct"),
    ]:
        with pytest.raises(ValueError, match=needle) as err:
            TrainConfig.from_dict({**_BASE, "tracking": bad}, source="run.toml")
        assert str(err.value).startswith("run.toml: ") and "\n" not in str(err.value)


def test_tracking_keys_are_not_resume_critical() -> None:
    old = TrainConfig.from_dict(_BASE)
    new = TrainConfig.from_dict(
        {**_BASE, "tracking": {"backends": ["tensorboard", "wandb"], "wandb_mode": "online"}}
    )
    assert resume_critical_changes(old, new) == []
    assert json.loads(json.dumps(new.model_dump(mode="json")))["tracking"]["backends"] == [
        "tensorboard",
        "wandb",
    ]
