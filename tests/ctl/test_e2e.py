"""The operator loop end to end, through the CLI, on real sshd + pct shim + LXC + tmux, running
the real trainer on CPU with configs/tiny-cpu.toml:

trust -> deploy -> start -> status shows a parsed step > 0 -> change the config -> restart ->
status shows the new config hash -> stop leaves a checkpoint -> redeploy transfers nothing.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest

from dflashctl.cli import main as cli_main
from dflashctl.runconfig import config_hash_of_file
from tests.conftest import require_part
from tests.ctl import parts as P

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.parts, pytest.mark.slow, pytest.mark.timeout(420)]


def status_json(inv: list[str], capsys: pytest.CaptureFixture[str]) -> dict:
    capsys.readouterr()
    assert cli_main([*inv, "status", "ct", "--json"]) == 0
    return json.loads(capsys.readouterr().out)[0]


def wait_status(inv: list[str], capsys: pytest.CaptureFixture[str], pred, timeout: float) -> dict:
    end = time.monotonic() + timeout
    while True:
        st = status_json(inv, capsys)
        if pred(st):
            return st
        assert st["state"] in {"running", "stopped"}, f"trainer died: {st}"
        assert time.monotonic() < end, f"condition not reached within {timeout}s: {st}"
        time.sleep(2)


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
    st = wait_status(inv, capsys, lambda s: (s["step"] or 0) > 0, timeout=180)
    assert st["state"] == "running" and st["config_hash"] == first_hash

    text, old_lr, new_lr = P.halve_lr(cfg.read_text())
    cfg.write_text(text)
    new_hash = config_hash_of_file(cfg)
    assert new_hash != first_hash
    capsys.readouterr()
    assert cli_main([*inv, "restart", "ct", "--timeout", "90", "--tree", str(tree)]) == 0
    out = capsys.readouterr().out
    assert f"-{old_lr}" in out and f"+{new_lr}" in out  # the diff was shown
    st = wait_status(
        inv, capsys, lambda s: s["config_hash"] == new_hash and s["state"] == "running", timeout=120
    )

    capsys.readouterr()
    assert cli_main([*inv, "stop", "ct", "--timeout", "90"]) == 0
    out = capsys.readouterr().out
    assert "checkpoint step" in out
    ckpts = list((clean_workdir / "run" / "checkpoints").glob("step-*.pt"))
    assert ckpts, "stop left no checkpoint"
    assert status_json(inv, capsys)["state"] == "stopped"

    assert cli_main([*inv, "deploy", "ct", "--tree", str(tree)]) == 0
    assert "already present, nothing sent" in capsys.readouterr().out
