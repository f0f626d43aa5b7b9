"""The operator loop end to end, through the CLI, on real sshd + pct shim + LXC + tmux, running
the real trainer on CPU with configs/tiny-cpu.toml:

trust -> deploy -> start -> status shows a parsed step > 0 -> change the config -> restart ->
status shows the new config hash -> stop leaves a checkpoint -> redeploy transfers nothing.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.runconfig import config_hash_of_file
from tests import budget
from tests.conftest import require_part
from tests.ctl import parts as P

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.parts, pytest.mark.slow, pytest.mark.timeout(420)]


def status_json(inv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    capsys.readouterr()
    assert cli_main([*inv, "status", "ct", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)[0]
    assert isinstance(got, dict)
    return got


def wait_status(
    inv: list[str],
    capsys: pytest.CaptureFixture[str],
    pred: Callable[[dict[str, Any]], bool],
) -> dict[str, Any]:
    """`status --json` until `pred` holds (within the test's one budget)."""
    seen: list[dict[str, Any]] = []

    def holds() -> dict[str, Any] | None:
        st = status_json(inv, capsys)
        seen[:] = [st]
        assert st["state"] in {"running", "stopped"}, f"trainer died: {st}"
        return st if pred(st) else None

    return budget.until(
        holds, budget.described(pred), every=2, detail=lambda: f"last status: {seen}"
    )


def test_operator_loop_end_to_end(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    require_part(
        (REPO / "trainer" / "__main__.py").is_file()
        and (REPO / "configs" / "tiny-cpu.toml").is_file(),
        "the real trainer (python -m trainer, configs/tiny-cpu.toml) is not in this checkout",
    )
    # A frozen copy of the trainer tree, so edits elsewhere in the checkout can't race the test.
    tree = tmp_path / "tree"
    shutil.copytree(
        REPO / "trainer", tree / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    cfg = tmp_path / "run.toml"
    cfg.write_text((REPO / "configs" / "tiny-cpu.toml").read_text())
    inv_path = tmp_path / "hosts.toml"
    inv_path.write_text(
        P.hosts_toml(real_parts, known_hosts=tmp_path / "known_hosts", run_config=cfg)
        + 'env = { OMP_NUM_THREADS = "1" }\n'
    )
    inv = ["--hosts", str(inv_path)]

    assert cli_main([*inv, "trust", "ct", "--yes"]) == 0
    assert cli_main([*inv, "deploy", "ct", "--tree", str(tree)]) == 0
    assert "sent " in capsys.readouterr().out
    # the planner runs in the container on data there (a small lengths file in the workdir)
    np = pytest.importorskip("numpy")
    np.save(clean_workdir / "lengths.npy", np.random.default_rng(0).integers(16, 96, 2000))
    capsys.readouterr()
    store = f"{P.CONTAINER_WORKDIR}/lengths.npy"
    assert (
        cli_main(
            [
                *inv,
                "buckets",
                "ct",
                "--store",
                store,
                "--buckets",
                "3",
                "--token-budget",
                "768",
                "--max-batch",
                "16",
                "--json",
            ]
        )
        == 0
    )
    plan = json.loads(capsys.readouterr().out)
    assert len(plan["boundaries"]) == 4

    assert cli_main([*inv, "start", "ct"]) == 0

    first_hash = config_hash_of_file(cfg)
    st = wait_status(inv, capsys, lambda s: (s["step"] or 0) > 0)
    assert st["state"] == "running" and st["config_hash"] == first_hash

    text, old_lr, new_lr = P.halve_lr(cfg.read_text())
    cfg.write_text(text)
    new_hash = config_hash_of_file(cfg)
    assert new_hash != first_hash
    capsys.readouterr()
    stop_s = f"{budget.left():.0f}"  # the graceful stop's wait: whatever the budget has left
    assert cli_main([*inv, "restart", "ct", "--timeout", stop_s, "--tree", str(tree)]) == 0
    out = capsys.readouterr().out
    assert f"-{old_lr}" in out and f"+{new_lr}" in out  # the diff was shown
    st = wait_status(
        inv, capsys, lambda s: s["config_hash"] == new_hash and s["state"] == "running"
    )

    capsys.readouterr()
    assert cli_main([*inv, "stop", "ct", "--timeout", f"{budget.left():.0f}"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint step" in out
    ckpts = list((clean_workdir / "run" / "checkpoints").glob("step-*.pt"))
    assert ckpts, "stop left no checkpoint"
    assert status_json(inv, capsys)["state"] == "stopped"

    assert cli_main([*inv, "deploy", "ct", "--tree", str(tree)]) == 0
    assert "already present, nothing sent" in capsys.readouterr().out


def frozen_tree(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    shutil.copytree(
        REPO / "trainer", tree / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    return tree


def test_a_trainer_that_dies_at_once_is_a_failed_start(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The real trainer over sshd + pct + LXC + tmux: a device that does not exist and a store
    that is not a store used to be reported as "started" (exit 0) while the run was dead."""
    require_part((REPO / "configs" / "tiny-cpu.toml").is_file(), "configs/tiny-cpu.toml missing")
    tiny = (REPO / "configs" / "tiny-cpu.toml").read_text()
    bad_device = tmp_path / "bad-device.toml"
    bad_device.write_text(
        tiny.replace('drafter_devices = ["cpu"]', 'drafter_devices = ["cuda:99"]')
    )
    (clean_workdir / "empty-store").mkdir()
    no_store = tmp_path / "no-store.toml"
    no_synthetic = re.sub(r"(?ms)^\[data\.synthetic\]\n.*?(?=^\[)", "", tiny)  # never build one
    no_store.write_text(
        no_synthetic.replace(
            'store = ".cache/tiny-store"', f'store = "{P.CONTAINER_WORKDIR}/empty-store"'
        )
    )
    inv = P.pinned_inventory(real_parts, tmp_path)
    tree = frozen_tree(tmp_path)
    for cfg, said in (
        (bad_device, r"exited with status 2 .*: topology: device .cuda:99. requested"),
        (no_store, r"exited with status 2 \(refused: a user error\) .*data\.store: "),
    ):
        # --no-doctor: the trainer's own refusal is under test (doctor would refuse cuda:99
        # before it: tests/ctl/test_doctor.py)
        deploy = [*inv, "deploy", "ct", "--config", str(cfg), "--tree", str(tree), "--no-doctor"]
        assert cli_main(deploy) == 0
        capsys.readouterr()
        assert cli_main([*inv, "start", "ct", "--wait-s", "120", "--no-doctor"]) == 1
        captured = capsys.readouterr()
        err = captured.err.strip().splitlines()
        assert len(err) == 1 and "ct: the trainer " in err[0], captured
        assert re.search(said, err[0]), err[0]
        assert "started release" not in captured.out
        assert status_json(inv, capsys)["state"] == "crashed"
    # a refused resume: a config for a fresh start pushed on purpose, then a plain start
    from tests.ctl.test_local import write_checkpoint

    write_checkpoint(clean_workdir / "run", 40, tiny)
    bumped = tmp_path / "bumped.toml"
    bumped.write_text(P.bump_buckets(tiny))
    assert cli_main([*inv, "deploy", "ct", "--config", str(bumped), "--fresh"]) == 0
    capsys.readouterr()
    assert cli_main([*inv, "start", "ct", "--wait-s", "120"]) == 1
    refused = capsys.readouterr().err
    assert re.search(r"exited with status 2 .*step-00000040\.pt.*batching\.num_buckets", refused), (
        refused
    )


def test_deploy_config_is_checked_against_the_checkpoint_over_ssh(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The checkpoint's config is read in the container (its python, no torch import)."""
    require_part((REPO / "configs" / "tiny-cpu.toml").is_file(), "configs/tiny-cpu.toml missing")
    from tests.ctl.test_local import write_checkpoint

    tiny = (REPO / "configs" / "tiny-cpu.toml").read_text()
    run = clean_workdir / "run"
    run.mkdir()
    write_checkpoint(run, 40, tiny)
    bumped = tmp_path / "bumped.toml"
    bumped.write_text(P.bump_buckets(tiny))
    inv = P.pinned_inventory(real_parts, tmp_path)
    tree = frozen_tree(tmp_path)
    capsys.readouterr()
    assert cli_main([*inv, "deploy", "ct", "--config", str(bumped), "--tree", str(tree)]) == 1
    err = capsys.readouterr().err
    assert (
        "batching.num_buckets against the config saved in run/checkpoints/step-00000040.pt" in err
    )
    assert "dflashctl deploy ct --fresh" in err and not (run / "config.toml").exists()
    same = tmp_path / "same.toml"
    same.write_text(P.halve_lr(tiny)[0])  # lr may change across a resume
    assert cli_main([*inv, "deploy", "ct", "--config", str(same), "--tree", str(tree)]) == 0
    assert (run / "config.toml").read_text() == same.read_text()


def test_a_deploy_killed_during_preflight_leaves_a_lock_the_next_one_takes_over(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import signal
    import subprocess
    import sys

    inv = P.pinned_inventory(real_parts, tmp_path)
    tree = frozen_tree(tmp_path)
    lock = clean_workdir / ".deploy.lock"
    client = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", *inv, "deploy", "ct", "--tree", str(tree)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def locked() -> bool:
        assert client.poll() is None, "the deploy finished before it could be killed"
        return (lock / "owner").is_file() and bool((lock / "owner").read_text().strip())

    try:
        budget.until(locked, "the deploy took its lock", every=0.02)
        client.send_signal(signal.SIGKILL)  # the preflight (importing torch) is under way
    finally:
        client.wait()
    stale = (lock / "owner").read_text().strip()
    capsys.readouterr()
    assert cli_main([*inv, "deploy", "ct", "--tree", str(tree)]) == 0
    out = capsys.readouterr().out
    assert f"taking over a stale deploy lock: its owner ({stale}) is no longer running" in out
    assert "current None -> " in out and not lock.exists()


def test_hostile_status_log_reaches_logs_and_status_clean(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = clean_workdir / "run"
    run.mkdir()
    (run / "status.log").write_bytes(
        b"Starting pipeline...\n"
        b"\x1b]0;PWNED-TITLE\x07\x1b]52;c;cm0gLXJmIH4=\x07\x1b[31mERROR: red alert\x1b[0m\n"
        b"\x1b[32m[0m] step=4 loss=2.0000 acc=0.500 streak=1.0 lr=6.00e-04 noise=0.1000 | "
        b"tgt=1.00b/s dft=1.00b/s (2.0Ktok/s) | q_pre=[1] q_hs=[1] | epoch~0.01 ETA=17m\x1b[0m\n"
    )
    inv = P.pinned_inventory(real_parts, tmp_path)
    capsys.readouterr()
    assert cli_main([*inv, "logs", "ct", "-n", "5"]) == 0
    logs = capsys.readouterr().out
    assert cli_main([*inv, "status", "ct"]) == 0
    status = capsys.readouterr().out
    for text in (logs, status):
        assert "\x1b" not in text and "\x07" not in text and "PWNED" not in text
    assert logs.splitlines()[1] == "ERROR: red alert"
    assert "  error: red alert" in status and "step=4 " in status


def test_a_deploy_killed_right_after_sending_never_switches_current_unsaid(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """SIGKILL the deploy CLI the moment it prints "sending": whatever the node finished, the
    operator's next commands either find `current` where it was or say who switched it."""
    import signal
    import subprocess
    import sys

    inv = P.pinned_inventory(real_parts, tmp_path)
    tree = frozen_tree(tmp_path)
    client = subprocess.Popen(
        [sys.executable, "-m", "dflashctl", *inv, "deploy", "ct", "--tree", str(tree)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert client.stdout is not None
    try:
        for line in client.stdout:
            if ": sending " in line:
                client.send_signal(signal.SIGKILL)
                break
    finally:
        client.wait()
    assert client.returncode == -signal.SIGKILL, "the deploy ended before it was killed"
    budget.until(  # whatever the node was doing for the dead client finishes
        lambda: not P.node_processes(f"lxc-attach -n {real_parts.container.name} "),
        "the node's commands for the killed client to end",
        every=0.2,
    )
    switched = (clean_workdir / "current").is_symlink()
    capsys.readouterr()
    assert cli_main([*inv, "status", "ct"]) == 0
    status = capsys.readouterr().out
    assert switched == ("never reported back" in status), status
    assert cli_main([*inv, "deploy", "ct", "--tree", str(tree)]) == 0  # the lock is taken over
    out = capsys.readouterr().out
    assert "taking over a stale deploy lock" in out or switched
    assert (clean_workdir / "current").is_symlink() and not (
        clean_workdir / ".deploy.lock"
    ).exists()
