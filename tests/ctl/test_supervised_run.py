"""The supervised run from the operator's side, on the real parts (issue 12, items 2-3).

sshd on loopback + the pct shim + a real LXC container + tmux, the real `python -m
trainer.supervise` running the real tiny CPU trainer, driven through the CLI exactly as an
operator would. One deployed container (and one built tiny store/target) serves every test in
this module, in order; each test states the run it starts.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from dflashctl.cli.main import main as cli_main
from tests import budget
from tests.conftest import require_part
from tests.ctl import parts as P
from tests.ctl.test_notify import SECRET, Receiver
from tests.ctl.test_watch import Lines, serving, write_urls
from trainer.events import StatusEvent, parse_line

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.parts, pytest.mark.slow, pytest.mark.timeout(600)]

# Short policy figures so a crash loop plays out in seconds, not the production minutes.
POLICY = (
    'restart = "on-failure"\nmax_restarts = 2\nrestart_window_s = 3600\n'
    "restart_backoff_s = 0.5\nstall_timeout_s = 300\nstartup_timeout_s = 600\n"
)


class Site:
    """The deployed container and the CLI pointed at it."""

    def __init__(self, parts: P.Parts, base: Path) -> None:
        self.parts, self.base = parts, base
        self.workdir = parts.container.workdir_host
        known = base / "known_hosts"
        pub = parts.sshd.host_pub.read_text().split()
        known.write_text(f"[127.0.0.1]:{parts.sshd.port} {pub[0]} {pub[1]}\n")
        self.known = known

    def inventory(
        self, name: str, *, env: str = "", policy: str = POLICY, top: str = ""
    ) -> list[str]:
        """hosts.toml `name` (`top`: top-level keys, before every table)."""
        path = self.base / f"{name}.toml"
        env_line = f'env = {{ OMP_NUM_THREADS = "1"{env} }}\n'
        inv = P.hosts_toml(self.parts, known_hosts=self.known) + env_line + policy
        path.write_text(top + inv)
        return ["--hosts", str(path)]

    def status(self, inv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
        capsys.readouterr()
        code = cli_main([*inv, "status", "ct", "--json"])
        got = json.loads(capsys.readouterr().out)[0]
        assert code == 0, got
        assert isinstance(got, dict)
        return got

    def wait(
        self,
        inv: list[str],
        capsys: pytest.CaptureFixture[str],
        pred: Callable[[dict[str, Any]], bool],
        what: str,
    ) -> dict[str, Any]:
        """`status --json` until `pred` holds, within the test's one budget."""
        seen: list[dict[str, Any]] = []

        def holds() -> dict[str, Any] | None:
            seen[:] = [self.status(inv, capsys)]
            return seen[0] if pred(seen[0]) else None

        return budget.until(holds, what, every=1, detail=lambda: f"last status: {seen}")

    def in_container(self, *argv: str) -> subprocess.CompletedProcess[str]:
        name = self.parts.container.name
        return subprocess.run(
            ["lxc-attach", "-n", name, "--", *argv], capture_output=True, text=True, check=False
        )

    def supervisor_file(self) -> dict[str, Any]:
        got = json.loads((self.workdir / "run" / "supervisor.json").read_text())
        assert isinstance(got, dict)
        return got


def tiny_config(base: Path, name: str, extra_schedule: str = "") -> Path:
    text = (REPO / "configs" / "tiny-cpu.toml").read_text()
    text = re.sub(r"(?m)^every_steps = \d+", "every_steps = 10", text)
    text = re.sub(r"(?m)^interval_s = \S+", "interval_s = 1", text)
    # long enough that no test's run finishes its plan under it (a loaded CI machine included);
    # the one that wants a finished run sets max_steps
    text = re.sub(r"(?m)^epochs = \d+", "epochs = 200", text)
    if extra_schedule:
        text = re.sub(r"(?m)^(min_lr = .*)$", r"\1\n" + extra_schedule, text)
    path = base / name
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def site(real_parts: P.Parts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Site]:
    require_part(
        (REPO / "trainer" / "supervise.py").is_file()
        and (REPO / "configs" / "tiny-cpu.toml").is_file(),
        "the real trainer and supervisor are not in this checkout",
    )
    base = tmp_path_factory.mktemp("supervised")
    s = Site(real_parts, base)

    def wipe() -> None:
        P.kill_tmux_in(real_parts.container)
        for child in s.workdir.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()

    wipe()
    tree = base / "tree"  # a frozen copy: edits elsewhere in the checkout cannot race it
    shutil.copytree(
        REPO / "trainer", tree / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    inv = s.inventory("plain")
    cfg = tiny_config(base, "run.toml")
    assert cli_main([*inv, "deploy", "ct", "--tree", str(tree), "--config", str(cfg)]) == 0
    s.tree = tree  # type: ignore[attr-defined]
    try:
        yield s
    finally:
        wipe()


def test_a_killed_trainer_is_restarted_from_its_checkpoint_and_status_lists_it(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = site.inventory("plain")
    capsys.readouterr()
    assert cli_main([*inv, "start", "ct", "--wait-s", "300"]) == 0
    out = capsys.readouterr().out
    assert "-m trainer.supervise --restart=on-failure --max-restarts=2" in out
    st = site.wait(inv, capsys, lambda s: s["last_checkpoint"] is not None, "a first checkpoint")
    assert st["state"] == "running" and st["restarts"] == []
    assert st["supervisor"]["state"] == "running" and st["supervisor"]["gave_up"] is False
    ckpt = st["last_checkpoint"]["step"]
    trainer_pid = st["supervisor"]["trainer_pid"]
    killed = site.in_container("kill", "-9", str(trainer_pid))
    assert killed.returncode == 0, killed.stderr

    st = site.wait(
        inv,
        capsys,
        lambda s: bool(s["restarts"]) and s["restarts"][0]["resumed_step"] is not None,
        "a restart that resumed",
    )
    restart = st["restarts"][0]
    assert restart["reason"] == "signal 9" and restart["exit_status"] == -9
    assert restart["checkpoint_step"] is not None and restart["checkpoint_step"] >= ckpt
    assert restart["resumed_step"] == restart["checkpoint_step"]
    assert st["supervisor"]["trainer_pid"] != trainer_pid
    st = site.wait(
        inv,
        capsys,
        lambda s: s["state"] == "running" and (s["step"] or 0) > restart["resumed_step"],
        "a step past the checkpoint",
    )
    assert len(st["restarts"]) == 1  # one kill, one restart
    capsys.readouterr()
    assert cli_main([*inv, "status", "ct"]) == 0
    text = capsys.readouterr().out
    assert "ct: running " in text
    assert re.search(r"restart 1: signal 9, resumed from step \d+ \(\d+s ago\)", text), text

    # the link lost for a while (every pct call on the node hangs): the host is unreachable,
    # never crashed, and nothing is restarted; the run went on meanwhile
    lossy = site.inventory("lossy", policy=POLICY + "command_timeout = 2\n")
    before = st["step"]
    with P.hanging_pct(site.parts.sshd, 30):
        for _ in range(2):
            capsys.readouterr()
            assert cli_main([*lossy, "status", "ct", "--json"]) == 3  # all hosts unreachable
            got = json.loads(capsys.readouterr().out)[0]
            assert got["state"] == "unreachable" and "no answer within 2 s" in got["message"]
            assert got["restarts"] == [] and got["supervisor"] is None
            time.sleep(2)
    st = site.wait(inv, capsys, lambda s: (s["step"] or 0) > before, "steps after the outage")
    assert st["state"] == "running" and len(st["restarts"]) == 1

    capsys.readouterr()
    assert cli_main([*inv, "stop", "ct", "--timeout", f"{budget.left():.0f}"]) == 0
    assert "checkpoint step" in capsys.readouterr().out
    st = site.status(inv, capsys)
    assert st["state"] == "stopped" and site.supervisor_file()["state"] == "stopped"


def test_a_sigstopped_trainer_is_stalled_its_stacks_logged_and_it_is_restarted(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    # the trainer prints a status line every second with a new step: 10 s without one is a stall
    inv = site.inventory(
        "stall", policy=POLICY.replace("stall_timeout_s = 300", "stall_timeout_s = 10")
    )
    cfg = tiny_config(site.base, "run.toml")
    assert cli_main([*inv, "deploy", "ct", "--config", str(cfg)]) == 0
    capsys.readouterr()
    assert cli_main([*inv, "start", "ct", "--fresh", "--wait-s", "300"]) == 0
    assert "--stall-timeout-s=10.0" in capsys.readouterr().out

    def trained_past_a_checkpoint(s: dict[str, Any]) -> bool:
        # this run's own state (the log's last checkpoint line may be an earlier run's)
        rs, sup = s["run_state"] or {}, s["supervisor"] or {}
        return (
            rs.get("pid") == sup.get("trainer_pid")
            and rs.get("last_checkpoint") is not None
            and (rs.get("last_step") or 0) > 0
        )

    st = site.wait(inv, capsys, trained_past_a_checkpoint, "a first checkpoint")
    assert st["state"] == "running" and st["restarts"] == []
    pid = st["supervisor"]["trainer_pid"]
    try:
        stopped = site.in_container("kill", "-STOP", str(pid))
        assert stopped.returncode == 0, stopped.stderr
        stalled_and_restarted(site, inv, capsys, pid)
    finally:  # a failed check leaves no stopped trainer behind for the next test
        site.in_container("kill", "-CONT", str(pid))
        P.kill_tmux_in(site.parts.container)


def stalled_and_restarted(
    site: Site, inv: list[str], capsys: pytest.CaptureFixture[str], pid: int
) -> None:
    st = site.wait(
        inv,
        capsys,
        lambda s: bool(s["restarts"]) and s["restarts"][0]["resumed_step"] is not None,
        "the stall's restart",
    )
    (restart,) = st["restarts"]
    assert restart["reason"] == "stalled 10 s", restart
    assert restart["resumed_step"] == restart["checkpoint_step"] is not None
    assert st["supervisor"]["trainer_pid"] != pid
    console = (site.workdir / "run" / "console.log").read_text()
    assert f"trainer pid {pid} made no progress in status.log for " in console
    assert "State T (stopped)" in console  # the /proc snapshot, taken while it was stopped
    assert f"pid {pid} is stopped (SIGSTOP): sending SIGCONT so it can dump" in console
    stacks = console.split(f"thread stacks of pid {pid} (faulthandler, SIGUSR1) follow", 1)
    assert len(stacks) == 2, console[-3000:]
    assert "(most recent call first):" in stacks[1] and 'File "' in stacks[1], stacks[1][:3000]
    st = site.wait(
        inv,
        capsys,
        lambda s: s["state"] == "running" and (s["step"] or 0) > restart["resumed_step"],
        "a step after the resume",
    )
    capsys.readouterr()
    assert cli_main([*inv, "status", "ct"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"restart 1: stalled 10 s, resumed from step \d+ \(\d+s ago\)", text), text
    assert cli_main([*inv, "stop", "ct", "--timeout", f"{budget.left():.0f}"]) == 0
    st = site.status(inv, capsys)
    sup = site.supervisor_file()
    assert st["state"] == "stopped" and sup["state"] == "stopped" and len(sup["restarts"]) == 1


def test_a_finished_run_is_not_restarted(site: Site, capsys: pytest.CaptureFixture[str]) -> None:
    inv = site.inventory("plain")
    cfg = tiny_config(site.base, "short.toml", "max_steps = 3")
    assert cli_main([*inv, "deploy", "ct", "--config", str(cfg), "--fresh"]) == 0
    assert cli_main([*inv, "start", "ct", "--fresh", "--wait-s", "300"]) == 0
    st = site.wait(inv, capsys, lambda s: s["state"] != "running", "the end of the plan")
    assert st["state"] == "stopped" and st["finished"] and st["exit_status"] == 0, st
    assert st["restarts"] == [] and st["supervisor"]["state"] == "finished"
    time.sleep(2)  # a restart would have begun by now (backoff 0.5 s)
    st = site.status(inv, capsys)
    assert st["state"] == "stopped" and st["restarts"] == []
    assert site.supervisor_file()["attempt"] == 1


def test_stop_during_a_restart_backoff_stops_for_good(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    # a device that does not exist: exit 2 at every start, made restartable here by the
    # inventory (no_restart_exit_codes = [3]); a backoff longer than any test budget keeps the
    # supervisor waiting however slowly the steps below run (the stop cuts it short)
    inv = site.inventory(
        "restartable-config-error",
        policy=POLICY.replace("restart_backoff_s = 0.5", "restart_backoff_s = 7200")
        + "no_restart_exit_codes = [3]\n",
    )
    text = tiny_config(site.base, "run.toml").read_text()
    bad = site.base / "bad-device.toml"
    bad.write_text(text.replace('drafter_devices = ["cpu"]', 'drafter_devices = ["cuda:99"]'))
    # --no-doctor: the trainer's own refusal is under test (doctor refuses cuda:99 first)
    assert cli_main([*inv, "deploy", "ct", "--config", str(bad), "--fresh", "--no-doctor"]) == 0
    capsys.readouterr()
    # the trainer died at once: a failed start, although the supervisor lives on to restart it
    assert cli_main([*inv, "start", "ct", "--wait-s", "300", "--no-doctor"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert re.search(
        r"^dflashctl: ct: the trainer exited with status 2 \(refused: a user error\) \d+ s after "
        r"it was started: topology: device .cuda:99. requested.*; its supervisor restarts it "
        r"\(restart 1 of 2, in 7200 s\): `dflashctl stop ct` ends it$",
        err[0],
    ), err[0]
    st = site.status(inv, capsys)
    assert st["state"] == "restarting" and st["supervisor"]["state"] == "restarting"
    assert [r["reason"] for r in st["restarts"]] == ["exit 2"]
    capsys.readouterr()
    assert cli_main([*inv, "stop", "ct", "--timeout", f"{budget.left():.0f}"]) == 0
    assert (
        "stopped (exited); it was in a restart backoff: nothing unsaved" in capsys.readouterr().out
    )
    st = site.wait(
        inv,
        capsys,
        lambda s: s["state"] == "stopped" and site.supervisor_file()["state"] == "stopped",
        "the session and its supervisor to end",
    )
    assert st["state"] == "stopped" and st["exit_status"] is None  # session ended
    sup = site.supervisor_file()
    assert sup["state"] == "stopped" and sup["attempt"] == 1 and len(sup["restarts"]) == 1
    assert "during the restart backoff" in sup["detail"]
    assert "trainer" not in site.in_container("ps", "-eo", "args").stdout


def test_a_crash_loop_is_restarted_max_restarts_times_then_gave_up(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    # every attempt fails in a stage (exit 1, the test-only DFLASH_FAULT hook), watched by a
    # `dflashctl watch` process notifying a real receiver: one message for the whole loop
    rx = Receiver()
    urls = write_urls(site.base, rx.url())
    inv = site.inventory(
        "faulty", env=', DFLASH_FAULT = "drafter:1"', top=f'notify_urls_file = "{urls.name}"\n'
    )
    cfg = tiny_config(site.base, "run.toml")
    assert cli_main([*inv, "deploy", "ct", "--config", str(cfg)]) == 0
    capsys.readouterr()
    exe = Path(sys.executable).with_name("dflashctl")
    watch_argv = [str(exe), *inv, "watch", "ct", "--interval-s", "1", "--burst-s", "90"]
    with serving(rx):
        watch = subprocess.Popen(
            watch_argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        try:
            out, err = Lines(watch.stdout), Lines(watch.stderr)
            err.wait_for(r"watching ct every 1 s .*notifying 1 target")
            time.sleep(2.5)  # polls of the stopped host: the watch knows it before the start
            cli_main([*inv, "start", "ct", "--fresh", "--wait-s", "0"])
            st = site.wait(inv, capsys, lambda s: s["state"] == "gave-up", "gave up")
            out.wait_for(r" ct gave-up: ")

            def notified() -> bool:  # at the end of the burst window (90 s) from the first restart
                assert watch.poll() is None, (out.lines, err.lines)
                return bool(rx.received)

            budget.until(notified, "the gave-up notification", every=0.2)
            time.sleep(5)  # five more polls of the gave-up host: nothing is repeated
            watch.send_signal(signal.SIGTERM)
            assert budget.wait(watch, "the watch to exit after SIGTERM") == 0, err.lines
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait(10)
    kinds = [re.sub(r"^\S+ ct ([a-z-]+).*", r"\1", ln) for ln in out.lines]
    assert kinds == ["restarted", "restarted", "gave-up"], out.lines
    (note,) = rx.received
    assert note["title"] == "dflash ct: gave-up" and note["type"] == "failure", note
    body = note["message"].splitlines()
    assert [re.sub(r"^\S+ ct ([a-z-]+).*", r"\1", ln) for ln in body] == kinds, body
    assert re.search(r" ct gave-up: (at step \d+, )?gave up after 2 restarts in ", body[2]), body
    assert ": exit 1, exit 1, exit 1; last error: " in body[2] and "InjectedFault" in body[2]
    assert SECRET not in "\n".join(err.lines)
    assert [r["reason"] for r in st["restarts"]] == ["exit 1", "exit 1"]
    assert st["supervisor"]["gave_up"] is True and st["exit_status"] == 1
    capsys.readouterr()
    assert cli_main([*inv, "status", "ct"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("ct: gave-up exit=1 ")
    assert "supervisor: gave up after 2 restarts in " in text and "exit 1, exit 1, exit 1" in text
    # a start clears the dead pane and starts again: gave-up is not a live state
    capsys.readouterr()
    assert cli_main([*inv, "stop", "ct"]) == 0
    assert "not running: the run had already exited with status 1" in capsys.readouterr().out


def _pane_lines(site: Site) -> list[str]:
    """The trainer's tmux pane, as the operator would read it by hand."""
    got = site.in_container(
        "tmux", "-L", "dflash", "capture-pane", "-p", "-J", "-S", "-", "-t", "=dflash-test:"
    )
    return got.stdout.splitlines()


def _last_step(lines: list[str]) -> int | None:
    steps = [e.step for e in map(parse_line, lines) if isinstance(e, StatusEvent)]
    return steps[-1] if steps else None


def test_a_stop_whose_checkpoint_is_not_written_fails_and_says_what_was_lost(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    """run/checkpoints on a full volume of its own: the stop's checkpoint fails, so `stop`
    exits 1 naming the trainer's own account, and status names the checkpoint not written."""
    inv = site.inventory("plain")
    rare = site.base / "rare-checkpoints.toml"
    text = tiny_config(site.base, "run.toml").read_text()
    rare.write_text(re.sub(r"(?m)^every_steps = \d+", "every_steps = 100000", text))
    assert cli_main([*inv, "deploy", "ct", "--config", str(rare)]) == 0
    assert cli_main([*inv, "start", "ct", "--fresh", "--wait-s", "300"]) == 0
    site.wait(inv, capsys, lambda s: (s["step"] or 0) >= 3, "three steps")
    ckpts = f"{P.CONTAINER_WORKDIR}/run/checkpoints"
    with P.container_tmpfs(site.parts, ckpts, "64k"):
        P.attach(site.parts, 'dd if=/dev/zero of="$1/fill" bs=4k 2>/dev/null; true', ckpts)
        capsys.readouterr()
        assert cli_main([*inv, "stop", "ct", "--timeout", "120"]) == 1
        out = capsys.readouterr().out
        assert re.search(
            r"^ct: stopped \(exited, exit status 1\); its checkpoint was NOT written: "
            r"stopped at step (\d+) without its checkpoint: starting over repeats \1 step\(s\)$",
            out,
            re.M,
        ), out
        st = site.status(inv, capsys)
        failed = st["checkpoint_failed"]
        assert failed["directory"].endswith("run/checkpoints"), failed
        assert failed["reason"].startswith("no space left ("), failed
        capsys.readouterr()
        assert cli_main([*inv, "status", "ct"]) == 0
        assert f"  checkpoint NOT written: step {failed['step']} to " in capsys.readouterr().out


def test_status_stays_true_when_the_run_directory_is_completely_full(
    site: Site, capsys: pytest.CaptureFixture[str]
) -> None:
    """run/ on a tmpfs filled to the last byte while the trainer trains: status.log, run-state
    and supervisor.json all stop; status reads the step and the supervisor's state from the
    pane, says that supervisor.json is out of date because the disk is full, and names the
    checkpoint that was not written."""
    inv = site.inventory("plain")
    config = tiny_config(site.base, "run.toml")
    # status lines every 0.2 s: the 10-20 steps between the fill and the stop (two failed
    # checkpoints) print some, however fast the steps run
    config.write_text(re.sub(r"(?m)^interval_s = \S+", "interval_s = 0.2", config.read_text()))
    assert cli_main([*inv, "deploy", "ct", "--config", str(config)]) == 0
    run = f"{P.CONTAINER_WORKDIR}/run"
    P.attach(site.parts, 'cp "$1/config.toml" /tmp/dflt-run-config.toml', run)
    try:
        with P.container_tmpfs(site.parts, run, "48m"):
            P.attach(site.parts, 'cp /tmp/dflt-run-config.toml "$1/config.toml"', run)
            assert cli_main([*inv, "start", "ct", "--fresh", "--wait-s", "300"]) == 0
            site.wait(inv, capsys, lambda s: (s["step"] or 0) >= 3, "three steps")
            # to the last byte: tmpfs hands out pages, so status.log's last one is topped up too;
            # the trainer stopped meanwhile, so that no status line or checkpoint of it races the
            # fill (on a loaded machine it used to land its last line while dd ran)
            fill = (
                'pkill -STOP -f "^[^ ]*python[^ ]* -m trainer --config"; '
                'dd if=/dev/zero of="$1/fill" bs=16k 2>/dev/null; '
                'while echo "# filler: the disk is full" >> "$1/status.log"; do :; done 2>/dev/null; '
                'pkill -CONT -f "^[^ ]*python[^ ]* -m trainer --config"; true'
            )
            P.attach(site.parts, fill, run)
            st = site.wait(inv, capsys, lambda s: s["state"] != "running", "the run to end")
            pane = _pane_lines(site)
            log = P.attach(site.parts, 'cat "$1/status.log"', run).splitlines()
            pane_step, log_step = _last_step(pane), _last_step(log)
            assert pane_step is not None and log_step is not None and pane_step > log_step
            assert st["step"] == pane_step  # not status.log's, which the full disk stopped
            assert st["state"] == "crashed" and st["exit_status"] == 3, st
            assert st["supervisor"]["state"] == "not-restarted", st["supervisor"]
            assert "checkpoints kept failing" in (st["supervisor"]["detail"] or "")
            assert st["stale_note"] == (  # the supervisor's --run-dir, relative to the workdir
                "run/supervisor.json is out of date: not written (No space left on device: "
                "the disk is full); the supervisor's state is read from its pane"
            )
            assert st["checkpoint_failed"] is not None
            capsys.readouterr()
            assert cli_main([*inv, "status", "ct"]) == 0
            text = capsys.readouterr().out
            assert f"  note: {st['stale_note']}" in text
            assert "exit=3 " in text and "  supervisor: checkpoints kept failing" in text
            P.kill_tmux_in(site.parts.container)
    finally:
        P.kill_tmux_in(site.parts.container)
