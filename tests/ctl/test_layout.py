"""The remote layout and the run/release/probe builders: exact argv and script text, and the
scripts run for real against a workdir laid out as the layout says (sh, no tmux needed)."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

from dflashctl.releases.release import VERIFY_SCRIPT
from dflashctl.remote import commands as C
from dflashctl.remote import layout as L
from dflashctl.remote import probe as P
from dflashctl.remote import release as R
from dflashctl.remote import run as U
from dflashctl.remote.layout import RemoteLayout
from tests import budget


def test_the_layout_names_every_path_once_under_the_workdir() -> None:
    lay = RemoteLayout("/srv/dflash")
    assert lay.run_dir == "/srv/dflash/run"
    assert lay.config == "/srv/dflash/run/config.toml"
    assert lay.status_log == "/srv/dflash/run/status.log"
    assert lay.run_state == "/srv/dflash/run/run-state.json"
    assert lay.supervisor_state == "/srv/dflash/run/supervisor.json"
    assert lay.running_release == "/srv/dflash/run/.release"
    assert lay.deploy_lock == "/srv/dflash/.deploy.lock"
    assert lay.release_dir("abc") == "/srv/dflash/releases/abc"
    assert lay.secret("hf") == "/srv/dflash/secrets/hf"
    assert L.CURRENT == "current" and L.SWITCH_MARKER == ".deploy-switched"


def test_file_reads_are_exact_argv() -> None:
    assert C.tail_from("/w/run/status.log", 41) == ["tail", "-n", "+42", "/w/run/status.log"]
    assert C.line_count("/w/run/status.log") == ["wc", "-l", "/w/run/status.log"]
    assert C.describe(C.line_count("/w/x.log")) == "counting the lines of /w/x.log"
    assert C.describe(C.tail_from("/w/x.log")) == "reading /w/x.log"


def test_run_builders_are_exact_argv() -> None:
    assert U.status_argv("/w", "s") == ["sh", "-c", U.STATUS_SCRIPT, "dflash-status", "/w", "s"]
    assert U.trainer_argv("py", True) == [
        "py", "-m", "trainer", "--config", "run/config.toml", "--run-dir", "run", "--fresh"
    ]  # fmt: skip
    assert U.gpu_query_argv() == [
        "nvidia-smi",
        f"--query-gpu={U.GPU_QUERY}",
        "--format=csv,noheader,nounits",
    ]
    start = U.start_wait_argv("/w", "s", 9, 1.0)
    assert start == [
        "sh", "-c", U.START_WAIT_SCRIPT, "dflash-start-wait", "/w", "s", "10", "5",
        U.READY_PATTERN, U.RESTARTING_PATTERN,
    ]  # fmt: skip
    stop = U.stop_wait_argv("/w", "s", 9, 0.1)  # never fewer than one tick
    assert stop == ["sh", "-c", U.STOP_WAIT_SCRIPT, "dflash-stop", "/w", "s", "10", "1"]
    assert C.describe(start) == "waiting for the trainer's setup"
    assert C.describe(stop) == "waiting for the trainer to stop"


def test_the_scripts_use_the_layout_names() -> None:
    for name in (L.RUN_STATE, L.STATUS_LOG, L.CONFIG, L.SUPERVISOR_STATE, L.RUNNING_RELEASE):
        assert f" {name} " in U.STATUS_SCRIPT
    assert f"{L.CURRENT}/{L.SUPERVISOR_SOURCE}" in U.STATUS_SCRIPT
    assert f'mv -f "{L.RUN_DIR}/.config.toml.tmp.$$" {L.CONFIG}' in R.SWITCH_SCRIPT
    assert f"rm -rf {L.DEPLOY_LOCK}\n" in R.SWITCH_SCRIPT


# sha256 of the probe texts as rendered from the layout's names (pinned when they were inline:
# a change to what containers run is made on purpose; the memory probe's last change: it
# measures free space in run/checkpoints when that exists, a volume of its own or not).
INLINE_PROBE_SHA256 = "627558de8b7c784f7ce58f390eded9cc1bb937e6a7981bddc21aced45819b161"
INLINE_MEMORY_SHA256 = "a4eeb80c8380ceea32f246621481e758914cbd19cd3627f9bc263f645fdd230a"


def test_the_python_probes_render_from_the_layout_byte_identical() -> None:
    assert hashlib.sha256(P.PROBE_SCRIPT.encode()).hexdigest() == INLINE_PROBE_SHA256
    assert hashlib.sha256(P.MEMORY_SCRIPT.encode()).hexdigest() == INLINE_MEMORY_SHA256
    assert "$" not in P.PROBE_SCRIPT + P.MEMORY_SCRIPT  # every slot filled
    assert P.py_names(L.CHECKPOINTS) == '"run", "checkpoints"'
    assert P.py_names(L.CHECKPOINTS, under=L.RUN_DIR) == '"checkpoints"'
    assert f"os.path.join(rel, {P.py_names(L.MEMORY_SOURCE)})" in P.MEMORY_SCRIPT


def test_release_builders_are_exact_argv() -> None:
    assert R.unlock_argv("/w", "me")[3:] == ["dflash-unlock", "/w", "me"]
    assert R.locked_argv("/w", "me", ["true"])[3:] == ["dflash-lock", "/w", "me", "true"]
    assert R.switch_argv("/w", "id", 3, with_config=True, owner="me")[3:] == [
        "dflash-switch", "/w", "id", "3", "config", "me"
    ]  # fmt: skip
    assert R.unpack_argv("/w", "id", "py", VERIFY_SCRIPT)[3:] == [
        "dflash-unpack", "/w", "id", "py", VERIFY_SCRIPT
    ]  # fmt: skip
    assert R.acknowledge_switch("/w")[3:] == ["dflash-ack", "/w", ""]
    assert P.probe_argv("py", "/w", "id", import_check=False) == [
        "py", "-c", P.PROBE_SCRIPT, "/w", "id", "metadata"
    ]  # fmt: skip
    assert P.memory_argv("py", "/w", "id", 81920)[-1] == "81920MiB"
    assert P.memory_argv("py", "/w", "id", None)[-1] == "-"
    assert C.describe(P.probe_argv("python3", "/w", "id")) == "preflight"


def _sh(argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=budget.left())


def test_lock_take_over_and_break_run_for_real(tmp_path: Path) -> None:
    wd = str(tmp_path / "wd")
    lay = RemoteLayout(wd)
    assert _sh(R.locked_argv(wd, "me pid 1", ["true"])).returncode == 0
    assert Path(lay.deploy_lock, "owner").read_text() == "me pid 1\n"
    held = _sh(R.locked_argv(wd, "you pid 2", ["true"]))
    assert (held.returncode, held.stdout.strip()) == (R.LOCK_HELD_RC, "held by: me pid 1")
    assert _sh(R.read_lock_owner_argv(wd)).stdout == "me pid 1\n"
    assert _sh(R.take_over_argv(wd, "someone else")).returncode == R.LOCK_HELD_RC
    assert _sh(R.take_over_argv(wd, "me pid 1")).returncode == 0
    assert not Path(lay.deploy_lock).exists()
    assert _sh(R.break_lock_argv(wd)).stdout.strip() == "no lock"
    _sh(R.locked_argv(wd, "me pid 1", ["true"]))
    assert _sh(R.break_lock_argv(wd)).stdout.strip() == "broke: me pid 1"
    assert not Path(lay.deploy_lock).exists()


def test_the_start_wait_finds_ready_in_status_log_lines_after_the_mark(tmp_path: Path) -> None:
    # No tmux server on this socket: the pane reads "gone", so the script says "exited" at
    # once; with a stand-in `tmux` on PATH printing 0 (alive) it scans status.log instead.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "tmux").write_text("#!/bin/sh\necho 0\n")
    (bin_dir / "tmux").chmod(0o755)
    wd = tmp_path / "wd"
    (wd / L.RUN_DIR).mkdir(parents=True)
    (wd / L.STATUS_LOG).write_text("Pipeline running. Monitoring...\nnoise\n")
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin"}
    for mark, want in ((0, "ready"), (2, "waiting")):
        argv = U.start_wait_argv(str(wd), "s", mark, 0.4)
        out = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=budget.left())
        assert out.stdout.strip().splitlines()[-1] == want
    (wd / L.STATUS_LOG).write_text("Checkpoint saved: step=3 path=x\n")
    out = subprocess.run(
        U.stop_wait_argv(str(wd), "s", 0, 0.4), capture_output=True, text=True, env=env
    )
    assert out.stdout.strip() == "timeout"  # seen, but not 25 ticks yet within 2 ticks


def test_the_status_script_reads_the_layout(tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    (wd / L.RUN_DIR).mkdir(parents=True)
    (wd / L.RUN_STATE).write_text('{"pid": 1}')
    (wd / L.STATUS_LOG).write_text("a\nb\n")
    (wd / L.CONFIG).write_text("[x]\n")
    (wd / L.RUNNING_RELEASE).write_text("abc\n")
    out = subprocess.run(
        U.status_argv(str(wd), "nosuchsession"),
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "TMUX_TMPDIR": str(tmp_path)},
        timeout=budget.left(),
    ).stdout
    from dflashctl.runs.snapshot import split_sections

    got = split_sections(out)
    assert got["run_state"] == '{"pid": 1}' and got["log_lines"] == "2"
    assert got["config"] == "[x]" and got["run_release"] == "abc"
    assert got["session"] == "no" and got["supervisable"] == "no"


def test_python_probe_runs_against_the_layout(tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    (wd / L.RELEASES / "id").mkdir(parents=True)
    (wd / L.RELEASES / "id" / L.RELEASE_COMPLETE).touch()
    (wd / L.CURRENT).symlink_to(f"{L.RELEASES}/id")
    out = _sh(P.probe_argv(sys.executable, str(wd), "id", import_check=False)).stdout
    assert '"complete": true' in out and '"current": "id"' in out


def test_memory_probe_runs_against_the_layout(tmp_path: Path) -> None:
    wd = tmp_path / "wd"
    (wd / L.RELEASES / "id").mkdir(parents=True)
    (wd / L.CHECKPOINTS).mkdir(parents=True)
    (wd / L.CHECKPOINTS / "step-00000010.pt").write_bytes(b"x" * 1000)
    (wd / L.CHECKPOINTS / "other.pt").write_bytes(b"x" * 5)  # not a checkpoint file
    out = json.loads(_sh(P.memory_argv(sys.executable, str(wd), "id", None)).stdout)
    assert out["absent"] is True and out["existing_bytes"] == 1000
    source = wd / L.RELEASES / "id" / L.MEMORY_SOURCE
    source.parent.mkdir(parents=True)
    source.write_text("import sys; print('{}'); sys.exit(3)\n")
    argv = P.memory_argv(sys.executable, str(wd), "id", None)
    res = subprocess.run(argv, input="[x]", capture_output=True, text=True, timeout=budget.left())
    got = json.loads(res.stdout)
    assert got["rc"] == 3 and got["report"] == {} and "absent" not in got
    assert Path(got["tmp"]).parent == wd / L.RUN_DIR and not Path(got["tmp"]).exists()


def test_commands_names_the_pct_tmux_and_files_builders_from_their_modules() -> None:
    from dflashctl.remote import files, pct, tmux

    for module in (files, pct, tmux):
        public = [n for n in vars(module) if not n.startswith("_") and n != "annotations"]
        for name in public:
            if (
                callable(getattr(module, name))
                and getattr(getattr(module, name), "__module__", "") == module.__name__
            ):
                assert getattr(C, name) is getattr(module, name), name
