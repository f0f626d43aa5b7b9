"""`dflashctl gate HOST` and `start` with `gate = "before-start"` over the real parts: OpenSSH
sshd, the pct shim, an LXC container, tmux, and the real `python -m trainer.gate` on the tiny
config inside the container.

The gate passes on the committed trainer; a start after it does not run it again (cached per
release and config), a changed config runs it again; a release whose trainer writes a corrupted
export field (the layer ids one off) or has a broken mask rule (each block also sees the context
at its anchor) fails the gate at that stage, and start refuses with the gate's line. The broken
trees are real releases deployed from outside, as a buggy trainer version would be.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.errors import ExitCode
from tests.ctl import parts as P
from tests.ctl.test_jobs import tiny_gate_config

REPO = Path(__file__).resolve().parents[2]


def cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    capsys.readouterr()
    rc = cli_main(args)
    got = capsys.readouterr()
    return rc, got.out, got.err


def patched_tree(good: Path, dest: Path, rel: str, old: str, new: str) -> Path:
    """A copy of the trainer tree with one edit (the text must be there exactly once)."""
    shutil.copytree(good, dest, ignore=shutil.ignore_patterns("__pycache__"))
    path = dest / rel
    text = path.read_text()
    assert text.count(old) == 1, f"{rel}: {old!r} is not there once"
    path.write_text(text.replace(old, new))
    return dest


def shifted_export_tree(good: Path, dest: Path) -> Path:
    """The exporter writes dflash_config.target_layer_ids one off (the engines' convention)."""
    return patched_tree(
        good,
        dest,
        "trainer/model/export.py",
        "    return data\n\n\ndef config_from_json",
        "    ids = data['dflash_config']['target_layer_ids']\n"
        "    data['dflash_config']['target_layer_ids'] = [i + 1 for i in ids]\n"
        "    return data\n\n\ndef config_from_json",
    )


def leaky_mask_tree(good: Path, dest: Path) -> Path:
    """Training's mask lets each block also see the context at its own anchor (j <= a)."""
    return patched_tree(
        good,
        dest,
        "trainer/model/attention.py",
        "dense_dflash_mask(anchors, context_valid,",
        "dense_dflash_mask(anchors + 1, context_valid,",
    )


def gate_dirs(workdir: Path) -> list[str]:
    root = workdir / "gate"
    return sorted(p.name for p in root.iterdir()) if root.is_dir() else []


@pytest.mark.parts
@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_gate_over_ssh_and_start_requiring_it(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text(tiny_gate_config())
    inv = P.pinned_inventory(real_parts, tmp_path, run_config=cfg)
    inv_file = Path(inv[1])
    inv_file.write_text(inv_file.read_text() + 'gate = "before-start"\n')
    good = P.frozen_tree(tmp_path / "good")
    deploy = [*inv, "deploy", "ct", "--no-memory-check", "--no-doctor"]

    rc, out, err = cli([*inv, "gate", "ct"], capsys)
    assert rc == ExitCode.FAILED and "ct: nothing deployed; run `dflashctl deploy ct`" in err
    assert cli([*deploy, "--tree", str(good)], capsys)[0] == 0

    # dflashctl gate: followed stage by stage, PASSED
    rc, out, err = cli([*inv, "gate", "ct"], capsys)
    assert rc == 0, err
    assert re.match(r"ct: gate \d{8}T\d{6}Z: gate PASSED in [\d.]+ s: own loop tau ", out), out
    for stage in ("setup", "capture", "masks", "train", "decode", "export"):
        assert f"dflashctl: ct: gate {stage}: ok (" in err, err
    first = gate_dirs(clean_workdir)
    assert len(first) == 1

    # start: the gate passed on this release and config, so it is not run again
    rc, out, err = cli([*inv, "start", "ct"], capsys)
    assert rc == 0, out + err
    assert "ct: gate: passed before on release " in out and f"(gate {first[0]}); not run" in out
    assert "ct: started release " in out
    assert cli([*inv, "stop", "ct"], capsys)[0] == 0
    assert gate_dirs(clean_workdir) == first

    # a changed config is another key: start runs the gate (followed), then starts
    text, _, _ = P.halve_lr(cfg.read_text())
    cfg.write_text(text)
    assert cli([*deploy, "--tree", str(good), "--config", str(cfg)], capsys)[0] == 0
    rc, out, err = cli([*inv, "start", "ct"], capsys)
    assert rc == 0, out + err
    assert "ct: gate: running python -m trainer.gate on release " in out
    assert "ct: gate: gate train: ok (" in out and "ct: gate PASSED in " in out
    assert "ct: started release " in out
    assert cli([*inv, "stop", "ct"], capsys)[0] == 0
    second = gate_dirs(clean_workdir)
    assert len(second) == 2
    rc, out, err = cli([*inv, "start", "ct"], capsys)
    assert rc == 0 and "not run again" in out and gate_dirs(clean_workdir) == second, out
    assert cli([*inv, "stop", "ct"], capsys)[0] == 0
    started_from = (clean_workdir / "run" / ".release").read_text()

    # a release whose export has the layer ids one off: the gate fails at export, start refuses
    broken = shifted_export_tree(good, tmp_path / "shifted")
    assert cli([*deploy, "--tree", str(broken)], capsys)[0] == 0
    rc, out, err = cli([*inv, "start", "ct"], capsys)
    assert rc == ExitCode.FAILED, out + err
    refusal = [ln for ln in err.splitlines() if "start refused" in ln]
    assert len(refusal) == 1, err
    assert refusal[0].startswith("dflashctl: ct: gate FAILED at stage export: ")
    assert "dflash_config.target_layer_ids is [2, 6], the run used [1, 5]" in refusal[0]
    assert '`dflashctl gate ct --result` shows it; gate = "off" in hosts.toml' in refusal[0]
    assert "started release" not in out
    assert (clean_workdir / "run" / ".release").read_text() == started_from  # not started
    rc, out, err = cli([*inv, "gate", "ct", "--result"], capsys)
    assert rc == ExitCode.FAILED and "gate FAILED at stage export: " in out, out + err
    rc, out, err = cli([*inv, "gate", "ct", "--result", "--json"], capsys)
    got = json.loads(out)
    assert got["passed"] is False and got["host"] == "ct"
    assert [s["stage"] for s in got["stages"] if not s["ok"]] == ["export"]
    # a failed gate is no pass: the next start runs it again (and is refused again)
    rc, out, err = cli([*inv, "start", "ct"], capsys)
    assert rc == ExitCode.FAILED and "ct: gate: running python -m trainer.gate" in out

    # a release with a broken mask rule: the gate names the masks stage
    leaky = leaky_mask_tree(good, tmp_path / "leaky")
    assert cli([*deploy, "--tree", str(leaky)], capsys)[0] == 0
    rc, out, err = cli([*inv, "gate", "ct"], capsys)
    assert rc == ExitCode.FAILED, out + err
    assert "gate FAILED at stage masks: the training forward differs from the decoding " in out
