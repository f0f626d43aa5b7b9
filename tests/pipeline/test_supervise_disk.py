"""The supervisor's free-space checks on real, small tmpfs mounts (needs root to mount): a restart
that would hit the same full disk is not made; low disk while the trainer runs is one phase line
per filesystem and change and an entry in supervisor.json, and the trainer keeps running. Every
filesystem the trainer writes to is measured, once each: RUN/checkpoints, the exports or a
tracker's dir on a mount of its own is named when it is the short one."""

from __future__ import annotations

import contextlib
import os
import re
import time
from pathlib import Path

import pytest

from tests.conftest import tmpfs
from trainer import tracking
from trainer.config import TrainConfig
from trainer.events import PhaseEvent, parse_line, parse_state_stale
from trainer.model.export_files import run_export_dirs
from trainer.pipeline import checkpoint
from trainer.supervision.disk import (
    MIB,
    UNKNOWN,
    Retention,
    RetentionReader,
    check,
    checkpoint_need,
    config_of,
)
from trainer.supervision.filesystems import LOG_RESERVE, WRITES

from .conftest import REPO
from .test_supervise import Sup, _phases, _script, _sup_argv, _sup_state, _until, sups

__all__ = ["sups"]  # the fixture, used by name

# Writes RUN/checkpoints/step-00000001.pt of SIZE bytes (a stand-in for the trainer's), appends
# a line to RUN/../starts, then exits 1 (or, with WAIT, runs until RUN/done exists and exits 0).
CHILD = (
    "import os, sys, time\n"
    "run, size, wait = sys.argv[1], int(sys.argv[2]), sys.argv[3] == 'wait'\n"
    "os.makedirs(run + '/checkpoints', exist_ok=True)\n"
    "open(run + '/checkpoints/step-00000001.pt', 'wb').write(b'\\0' * size)\n"
    "open(run + '/../starts', 'a').write('start\\n')\n"
    "while wait and not os.path.exists(run + '/done'): time.sleep(0.05)\n"
    "sys.exit(0 if wait else 1)\n"
)


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def test_checkpoint_need_is_the_newest_complete_checkpoint(tmp_path: Path) -> None:
    assert checkpoint_need(tmp_path) == 0  # no checkpoints dir yet
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    (ck / "step-00000002.pt").write_bytes(b"x" * 200)
    (ck / "step-00000010.pt").write_bytes(b"x" * 300)
    (ck / ".step-00000020.pt.tmp-7").write_bytes(b"x" * 900)  # a write in progress
    (ck / "best.pt").write_bytes(b"x" * 800)
    assert checkpoint_need(tmp_path) == 300


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("size_mib", "restarted"), [(3, False), (1, True)])
def test_a_restart_onto_a_disk_without_room_for_a_checkpoint_is_not_made(
    small_fs: Path, sups: list[Sup], size_mib: int, restarted: bool
) -> None:
    """3 MiB checkpoint on a 4 MiB disk: < 1 MiB left, no restart; 1 MiB: restarts as usual."""
    run = small_fs / "run"
    argv = _sup_argv(
        run, "--max-restarts", "1", "--backoff-s", "0.05",
        child=[*_script(CHILD), str(run), str(size_mib * MIB), "exit"],
    )  # fmt: skip
    s = Sup(argv, small_fs.parent / "out")
    sups.append(s)
    assert s.wait() == 1
    starts = (small_fs / "starts").read_text().count("start")
    state = _sup_state(run)
    if restarted:
        assert starts == 2 and state["state"] == "gave-up" and state["low_disk"] is None
        return
    assert starts == 1 and state["restarts"] == [] and state["state"] == "not-restarted"
    (line,) = _phases(run, "not_restarting")
    assert line.detail.startswith(f"no space left on {run} (")
    assert ", checkpoint needs 3.0) after exit 1: " in line.detail
    assert line.detail.endswith("free space there, then dflashctl start HOST")
    assert state["detail"] == line.detail
    low = state["low_disk"]
    assert low["needed_mib"] == 3.0 and low["free_mib"] <= 1.0 and low["since"]
    assert s.text().count("Not restarting trainer: no space left") == 1


@pytest.mark.timeout(60)
def test_low_disk_while_training_is_one_line_per_change_and_the_trainer_keeps_running(
    small_fs: Path, sups: list[Sup]
) -> None:
    run, filler = small_fs / "run", small_fs / "filler"
    argv = _sup_argv(
        run, "--disk-check-s", "0.1",
        child=[*_script(CHILD), str(run), str(MIB), "wait"],
    )  # fmt: skip
    s = Sup(argv, small_fs.parent / "out")
    sups.append(s)
    _until(lambda: (small_fs / "starts").exists(), "the child's checkpoint")
    _until(lambda: _sup_state(run).get("state") == "running", "the supervisor")
    filler.write_bytes(b"\0" * (_free(small_fs) - MIB // 2))  # 0.5 MiB left, 1 MiB needed
    _until(lambda: len(_phases(run, "low_disk")) == 1, "the low_disk line")
    (line,) = _phases(run, "low_disk")
    assert line.detail.startswith("low: 0.") and line.detail.endswith(
        f" MiB free on {run}, checkpoint needs 1.0; the next checkpoint will fail unless space "
        "is freed"
    )
    first = _sup_state(run)["low_disk"]
    assert first["needed_mib"] == 1.0 and first["free_mib"] < 1.0
    # Still low, less free: later checks update the entry (same `since`) without a second line.
    with open(filler, "ab") as fh:
        fh.write(b"\0" * (MIB // 4))
    _until(
        lambda: (_sup_state(run).get("low_disk") or {}).get("free_mib", 9) < first["free_mib"],
        "a later check",
    )
    assert _sup_state(run)["low_disk"]["since"] == first["since"]
    assert len(_phases(run, "low_disk")) == 1
    assert _sup_state(run)["state"] == "running"  # not stopped for it
    filler.unlink()
    _until(lambda: _sup_state(run).get("low_disk", 0) is None, "the low_disk entry to clear")
    (run / "done").touch()
    assert s.wait() == 0
    details = [p.detail for p in _phases(run, "low_disk")]
    assert len(details) == 2 and details[1].startswith("ok again: ")
    assert _sup_state(run)["state"] == "finished"
    assert (small_fs / "starts").read_text().count("start") == 1


def _config(path: Path, keep_last: int, eval_every: int | None = None) -> Path:
    """The tiny CPU config with `checkpoint.keep_last` (and `[eval]` every N steps) set."""
    text = (REPO / "configs" / "tiny-cpu.toml").read_text()
    text = re.sub(r"(?m)^keep_last = \d+$", f"keep_last = {keep_last}", text)
    if eval_every is not None:
        text += f"\n[eval]\nholdout_rows = 4\nevery_steps = {eval_every}\n"
    path.write_text(text)
    TrainConfig.load(path)  # valid, as the supervisor will read it
    return path


def test_retention_is_read_from_the_config_and_reread_when_it_changes(tmp_path: Path) -> None:
    cfg = _config(tmp_path / "run.toml", keep_last=2)
    reader = RetentionReader(str(cfg))
    got = reader.read()
    assert (got.keep_last, got.evaluates, got.source, got.problem) == (2, False, str(cfg), None)
    _config(cfg, keep_last=5, eval_every=10)
    os.utime(cfg, ns=(1, 1))  # a different mtime even within the clock's resolution
    got = reader.read()
    assert (got.keep_last, got.evaluates) == (5, True)
    cfg.write_text("[checkpoint]\nkeep_last = 0\n")
    bad = reader.read()
    assert bad.source is None and bad.problem and str(cfg) in bad.problem
    assert RetentionReader(None).read() == UNKNOWN
    assert config_of(["python", "-m", "trainer", "--config", "c.toml"]) == "c.toml"
    assert config_of(["--config=d.toml", "--run-dir", "r"]) == "d.toml"
    assert config_of(["--run-dir", "r"]) is None


def test_the_need_is_the_checkpoints_retention_keeps_less_those_already_there(
    tmp_path: Path,
) -> None:
    ck = tmp_path / "checkpoints"
    ck.mkdir()
    keep2 = Retention(keep_last=2, source="c.toml")
    (ck / "step-00000010.pt").write_bytes(b"x" * MIB)
    d = check(tmp_path, keep2)
    assert d is not None and (d.checkpoint, d.slots, d.held, d.need) == (MIB, 3, MIB, 2 * MIB)
    assert d.text().endswith(
        ", checkpoints need 2.0 MiB: the newest checkpoint (1.0 MiB) x 3 checkpoints on disk at "
        "the peak of a write (checkpoint.keep_last 2 + 1 being written), less 1.0 MiB already "
        "there"
    )
    # retention full: two kept, the next one needs room for itself only
    (ck / "step-00000020.pt").write_bytes(b"x" * MIB)
    d = check(tmp_path, keep2)
    assert d is not None and (d.held, d.need) == (2 * MIB, MIB)
    # an evaluating run keeps the best too, and a best older than keep_last is one more on disk
    evals = Retention(keep_last=2, evaluates=True, keep_every_steps=100, source="c.toml")
    d = check(tmp_path, evals)
    assert d is not None and (d.slots, d.held, d.need) == (4, 2 * MIB, 2 * MIB)
    (ck / "step-00000030.pt").write_bytes(b"x" * MIB)
    os.symlink("step-00000010.pt", ck / "best.pt")
    d = check(tmp_path, keep2)  # best.pt set: counted although the config does not evaluate
    assert d is not None and d.best and (d.slots, d.held, d.need) == (4, 3 * MIB, MIB)
    assert (
        "the newest checkpoint (1.0 MiB) x 4 checkpoints on disk at the peak of a write "
        "(checkpoint.keep_last 2 + best + 1 being written), less 3.0 MiB already there"
    ) in d.text()
    every = check(tmp_path, evals)
    assert every is not None and "keep_every_steps 100 keeps more on top" in every.text()
    # no config: one checkpoint, the old wording
    d = check(tmp_path)
    assert d is not None and (d.slots, d.need) == (1, MIB)
    assert d.text().endswith(" MiB free, checkpoint needs 1.0")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("with_config", [True, False])
def test_low_disk_counts_what_the_configs_retention_keeps(
    small_fs: Path, sups: list[Sup], tmp_path: Path, with_config: bool
) -> None:
    """A 1 MiB checkpoint, 1.5 MiB free. With keep_last = 2 from the trainer argv's config,
    retention needs 2 MiB more: low (a later checkpoint will fail). Without a config one
    checkpoint is counted: not low."""
    run, filler = small_fs / "run", small_fs / "filler"
    cfg = _config(tmp_path / "run.toml", keep_last=2)
    child = [*_script(CHILD), str(run), str(MIB), "wait"]
    if with_config:
        child += ["--config", str(cfg)]  # the child ignores it; the supervisor reads it
    s = Sup(_sup_argv(run, "--disk-check-s", "0.1", child=child), small_fs.parent / "out")
    sups.append(s)
    _until(lambda: (small_fs / "starts").exists(), "the child's checkpoint")
    _until(lambda: _sup_state(run).get("state") == "running", "the supervisor")
    filler.write_bytes(b"\0" * (_free(small_fs) - 3 * MIB // 2))
    if not with_config:
        time.sleep(1)  # ten checks
        assert _phases(run, "low_disk") == [] and _sup_state(run)["low_disk"] is None
        (run / "done").touch()
        assert s.wait() == 0
        return
    _until(lambda: len(_phases(run, "low_disk")) == 1, "the low_disk line")
    (line,) = _phases(run, "low_disk")
    assert line.detail.startswith("low: 1.") and line.detail.endswith(
        f" MiB free on {run}, checkpoints need 2.0 MiB: the newest checkpoint (1.0 MiB) x 3 "
        "checkpoints on disk at the peak of a write (checkpoint.keep_last 2 + 1 being written), "
        "less 1.0 MiB already there; a later checkpoint will fail unless space is freed"
    ), line.detail
    low = _sup_state(run)["low_disk"]
    assert (low["needed_mib"], low["checkpoint_mib"], low["checkpoints"]) == (2.0, 1.0, 3)
    (run / "done").touch()
    assert s.wait() == 0
    assert _sup_state(run)["state"] == "finished"


@pytest.mark.timeout(60)
def test_a_crash_on_a_disk_low_for_retention_but_with_room_for_one_checkpoint_is_restarted(
    small_fs: Path, sups: list[Sup], tmp_path: Path
) -> None:
    """Low for keep_last = 2 (2 MiB needed, 1.5 free) but the next 1 MiB checkpoint fits: the
    restart is made (only a disk without room for one is refused) and low_disk stays set."""
    run = small_fs / "run"
    cfg = _config(tmp_path / "run.toml", keep_last=2)
    (small_fs / "filler").write_bytes(b"\0" * (_free(small_fs) - 5 * MIB // 2))
    child = [*_script(CHILD), str(run), str(MIB), "exit", "--config", str(cfg)]
    argv = _sup_argv(run, "--max-restarts", "1", "--backoff-s", "0.05", child=child)
    s = Sup(argv, small_fs.parent / "out")
    sups.append(s)
    assert s.wait() == 1
    state = _sup_state(run)
    assert (small_fs / "starts").read_text().count("start") == 2
    assert state["state"] == "gave-up" and [r["reason"] for r in state["restarts"]] == ["exit 1"]
    assert state["low_disk"]["needed_mib"] == 2.0 and state["low_disk"]["free_mib"] < 2.0
    assert _phases(run, "not_restarting") == []


def test_the_watched_directories_are_the_ones_the_trainer_writes() -> None:
    rel = {what: [r for w, r in WRITES if w == what] for what, _ in WRITES}
    assert rel["checkpoints"] == [checkpoint.checkpoint_dir(Path(".")).name]
    assert rel["exports"] == list(run_export_dirs())  # the names the runner exports into
    assert rel["exports"] == ["export", "export-bf16", "export-best", "export-best-bf16"]
    assert rel["tracker"] == [tracking.TB_DIR, "wandb"]  # wandb.init(dir=RUN) makes RUN/wandb
    assert rel["logs"] == ["."]


@pytest.mark.timeout(60)
def test_a_restart_onto_a_full_checkpoint_filesystem_of_its_own_is_not_made(
    tmp_path: Path, sups: list[Sup]
) -> None:
    """RUN on a roomy filesystem, RUN/checkpoints on a 4 MiB one of its own: a 3 MiB checkpoint
    leaves < 1 MiB there, so the crashed trainer is not restarted, and the line names
    RUN/checkpoints (RUN itself has room: measuring it alone, the supervisor restarted into the
    same failing saves)."""
    with tmpfs(tmp_path / "run", "64m") as run, tmpfs(run / "checkpoints", "4m") as ckpts:
        argv = _sup_argv(
            run, "--max-restarts", "1", "--backoff-s", "0.05",
            child=[*_script(CHILD), str(run), str(3 * MIB), "exit"],
        )  # fmt: skip
        s = Sup(argv, tmp_path / "out")
        sups.append(s)
        assert s.wait() == 1
        state = _sup_state(run)
        assert (tmp_path / "starts").read_text().count("start") == 1
        assert state["state"] == "not-restarted" and state["restarts"] == []
        (line,) = _phases(run, "not_restarting")
        assert line.detail.startswith(f"no space left on {ckpts} (")
        assert " MiB free, checkpoint needs 3.0) after exit 1: " in line.detail
        (low,) = _phases(run, "low_disk")
        assert low.detail.startswith("low: ") and f" MiB free on {ckpts}, " in low.detail
        assert low.detail.endswith("; the next checkpoint will fail unless space is freed")
        assert state["low_disk"]["path"] == str(ckpts)
        assert state["low_disk"]["holds"] == ["checkpoints"]
        assert [e["path"] for e in state["low_disks"]] == [str(ckpts)]


@pytest.mark.timeout(60)
def test_each_filesystem_the_trainer_writes_to_is_measured_once_and_named(
    tmp_path: Path, sups: list[Sup]
) -> None:
    """RUN, RUN/checkpoints (8 MiB), RUN/export (2 MiB; RUN/export-best a symlink into it) and
    RUN/tb (2 MiB) on four filesystems; a 3 MiB checkpoint. The checkpoints fit; the exports
    (about one checkpoint) do not, nor the tracker's reserve: one line for each of those two,
    naming it, none for the symlinked export-best (the same filesystem), none for RUN."""
    with contextlib.ExitStack() as mounts:
        run = mounts.enter_context(tmpfs(tmp_path / "run", "64m"))
        mounts.enter_context(tmpfs(run / "checkpoints", "8m"))
        export = mounts.enter_context(tmpfs(run / "export", "2m"))
        tb = mounts.enter_context(tmpfs(run / tracking.TB_DIR, "2m"))
        (export / "best").mkdir()
        (run / "export-best").symlink_to(export / "best")
        child = [*_script(CHILD), str(run), str(3 * MIB), "wait"]
        s = Sup(_sup_argv(run, "--disk-check-s", "0.1", child=child), tmp_path / "out")
        sups.append(s)
        _until(lambda: len(_phases(run, "low_disk")) == 2, "two low_disk lines")
        lines = {p.detail for p in _phases(run, "low_disk")}  # tb's first: no checkpoint yet
        assert lines == {
            f"low: 2.0 MiB free on {export}, the exports at the end need 3.0 MiB (the newest "
            "checkpoint's size); the export at the end will fail unless space is freed",
            f"low: 2.0 MiB free on {tb}, logs keep {LOG_RESERVE // MIB} MiB; logs and tracker "
            "files will stop being written unless space is freed",
        }
        state = _sup_state(run)
        assert [(e["path"], e["holds"]) for e in state["low_disks"]] == [
            (str(export), ["exports"]),
            (str(tb), ["tracker"]),
        ]
        assert state["low_disk"] == state["low_disks"][0] and state["low_disk"]["since"]
        assert state["low_disk"]["needed_mib"] == 3.0
        # the supervisor's own words travel with the figures (status and watch show them)
        assert {
            f"low: {e['text']}; {e['consequence']} unless space is freed"
            for e in state["low_disks"]
        } == lines
        (run / "done").touch()
        assert s.wait() == 0
        assert len(_phases(run, "low_disk")) == 2  # no line for RUN, nor a second per change


# Writes RUN/checkpoints/step-00000001.pt of SIZE bytes, fills the rest of the disk to the last
# byte, then exits 1.
FILL_AND_CRASH = (
    "import os, sys\n"
    "run, size = sys.argv[1], int(sys.argv[2])\n"
    "os.makedirs(run + '/checkpoints', exist_ok=True)\n"
    "open(run + '/checkpoints/step-00000001.pt', 'wb').write(b'\\0' * size)\n"
    "with open(run + '/filler', 'wb', buffering=0) as fh:\n"
    "    try:\n"
    "        while True: fh.write(b'\\0' * 4096)\n"
    "    except OSError: pass\n"
    "sys.exit(1)\n"
)


@pytest.mark.timeout(60)
def test_a_supervisor_that_cannot_write_its_state_file_says_so_on_its_pane(
    tmp_path: Path, sups: list[Sup]
) -> None:
    """RUN (a 1 MiB tmpfs) filled to the last byte by the trainer: supervisor.json can no longer
    be replaced and goes on saying `running`. The pane says so, naming the file and the full
    disk, and says what the supervisor is instead: not restarted, with its exit status."""
    with tmpfs(tmp_path / "run", "1m") as run:
        argv = _sup_argv(
            run, "--max-restarts", "1", "--backoff-s", "0.05",
            child=[*_script(FILL_AND_CRASH), str(run), str(MIB // 4)],
        )  # fmt: skip
        s = Sup(argv, tmp_path / "out")
        sups.append(s)
        assert s.wait() == 1
        pane = [parse_line(x) for x in s.text().splitlines()]
        lines = [e for e in pane if isinstance(e, PhaseEvent) and e.phase == "state_stale"]
        stale = [parse_state_stale(e.detail) for e in lines]
        assert lines and None not in stale, s.text()
        last = stale[-1]
        assert last is not None
        assert last.path == str(run / "supervisor.json")
        assert last.why == "No space left on device: the disk is full"
        assert (last.state, last.attempt, last.exit_status) == ("not-restarted", 1, 1)
        assert last.detail.startswith(f"no space left on {run} (")
        assert lines[-1].text.startswith(
            f"Supervisor state file stale: {run / 'supervisor.json'} not written (No space left "
            "on device: the disk is full), it is out of date: the supervisor is not-restarted, "
            "attempt 1, exit status 1; no space left on "
        )
        assert _sup_state(run)["state"] == "running"  # the file itself is stale
        assert "Not restarting trainer: no space left" in s.text()
