"""`dflashctl watch` on the real parts: loopback sshd + pct shim + LXC + tmux + the tiny CPU
trainer, notifications through apprise's `json://` to a real HTTP receiver on 127.0.0.1.

- the watch as a real subprocess: sshd stopped (listener and live connections) for longer than
  `unreachable_alert_s` while the run trains: "unreachable" is printed and sent, then
  "recovered" when sshd is back, the run's step has advanced meanwhile, and "finished" once the
  run completes its plan; each message once, in order; SIGTERM drains the queue and exits 0;
- a receiver that is down: the notification is retried, logged (redacted) and dropped, the watch
  goes on, and the next event reaches the receiver once it is up.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from pathlib import Path

import pytest

from dflashctl.alerts.events import format_event_line
from dflashctl.alerts.notify import Notifier, load_targets
from dflashctl.alerts.policy import PolicyConfig
from dflashctl.alerts.watch import HostPoller, WatchSettings, run_watch
from dflashctl.cli.main import main as cli_main
from dflashctl.config.inventory import HostConfig, load_inventory, local_host
from dflashctl.remote.connect import make_transport
from dflashctl.remote.transport import LocalTransport
from dflashctl.runs.control import RunControl
from tests import budget
from tests.conftest import require_part
from tests.ctl import parts as P
from tests.ctl.test_notify import SECRET, Receiver

REPO = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.parts]


@contextlib.contextmanager
def serving(rx: Receiver) -> Iterator[Receiver]:
    rx.thread.start()
    try:
        yield rx
    finally:
        rx.server.shutdown()
        rx.server.server_close()
        rx.thread.join(5)


def write_urls(d: Path, url: str) -> Path:
    p = d / "notify-urls"
    p.write_text(f"# the test receiver\n{url}\n")
    p.chmod(0o600)
    return p


def inventory(sd: P.Sshd, ct: P.Container, d: Path, top: str, host_extra: str = "") -> Path:
    """hosts.toml for a host behind `sd` (key pinned) with top-level watch keys."""
    known = d / "known_hosts"
    pub = sd.host_pub.read_text().split()
    known.write_text(f"[127.0.0.1]:{sd.port} {pub[0]} {pub[1]}\n")
    parts = P.Parts(sd, ct)
    inv = d / "hosts.toml"
    inv.write_text(top + P.hosts_toml(parts, known_hosts=known) + host_extra)
    return inv


def listener_pid(sd: P.Sshd) -> int:
    return int((sd.dir / "sshd.pid").read_text().split()[0])


def stop_sshd(sd: P.Sshd) -> None:
    """The node's sshd is gone: its listener and every live connection (the watch's too)."""
    pid = listener_pid(sd)
    children = subprocess.run(
        ["pgrep", "-P", str(pid)], capture_output=True, text=True, check=False
    ).stdout.split()
    os.kill(pid, signal.SIGTERM)
    for child in children:
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(child), signal.SIGKILL)

    def refused() -> bool:
        try:
            socket.create_connection(("127.0.0.1", sd.port), 1.0).close()
        except OSError:
            return True
        return False

    budget.until(refused, f"sshd on port {sd.port} to refuse connections")


def start_sshd(sd: P.Sshd) -> subprocess.Popen[bytes]:
    """The same sshd (config, port, host key) started again."""
    proc = subprocess.Popen(
        ["/usr/sbin/sshd", "-D", "-e", "-f", str(sd.dir / "sshd_config")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def listening() -> bool:
        assert proc.poll() is None, "sshd did not start again"
        with contextlib.suppress(OSError):
            socket.create_connection(("127.0.0.1", sd.port), 1.0).close()
            return True
        return False

    budget.until(listening, f"sshd listening again on port {sd.port}")
    return proc


class Lines:
    """A subprocess's stdout lines, read on a thread, waited for by pattern."""

    def __init__(self, stream: object) -> None:
        self.lines: list[str] = []
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream: object) -> None:
        for line in stream:  # type: ignore[attr-defined]
            with self._cond:
                self.lines.append(line.rstrip("\n"))
                self._cond.notify_all()

    def wait_for(self, pattern: str) -> str:
        """The first line matching `pattern`, waited for within the test's budget."""
        rx = re.compile(pattern)
        with self._cond:
            ok = self._cond.wait_for(
                lambda: any(rx.search(ln) for ln in self.lines), timeout=budget.left()
            )
            assert ok, f"no line matching {pattern!r} within the test's budget: {self.lines}"
            return next(ln for ln in self.lines if rx.search(ln))


def last_step(run_dir: Path) -> int:
    steps = re.findall(r"\bstep=(\d+)", (run_dir / "status.log").read_text())
    return int(steps[-1]) if steps else 0


def wait_until(pred, what: str) -> None:  # type: ignore[no-untyped-def]
    budget.until(pred, what, every=0.2)


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_watch_process_reports_an_outage_and_the_finish_once_each_in_order(
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
    tree = tmp_path / "tree"
    import shutil

    shutil.copytree(
        REPO / "trainer", tree / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    cfg = tmp_path / "run.toml"
    tiny = (REPO / "configs" / "tiny-cpu.toml").read_text()
    assert re.search(r"(?m)^epochs = 2$", tiny), "the tiny config's plan changed"
    cfg.write_text(re.sub(r"(?m)^epochs = 2$", "epochs = 4", tiny))  # long enough for an outage
    rx = Receiver()
    # a node of its own: this test stops its sshd; the container is the shared one
    with serving(rx), P.sshd(tmp_path / "sshd") as sd:
        sd.map_file.write_text(f"{real_parts.container.ctid} {real_parts.container.name}\n")
        ct = real_parts.container  # its config, as `pct config` reads it on a real node
        P.write_ct_conf(sd, ct.ctid, P.default_ct_conf(ct.name))
        urls = write_urls(tmp_path, rx.url())
        inv = inventory(
            sd,
            real_parts.container,
            tmp_path,
            f'notify_urls_file = "{urls.name}"\nunreachable_alert_s = 3\n',
            f'run_config = "{cfg}"\ncommand_timeout = 10\nenv = {{ OMP_NUM_THREADS = "1" }}\n',
        )
        args = ["--hosts", str(inv)]
        assert cli_main([*args, "deploy", "ct", "--tree", str(tree)]) == 0
        assert cli_main([*args, "start", "ct", "--wait-s", "180"]) == 0
        run_dir = clean_workdir / "run"
        wait_until(lambda: last_step(run_dir) > 0, "a first step")

        exe = Path(sys.executable).with_name("dflashctl")
        watch = subprocess.Popen(
            [str(exe), *args, "watch", "all", "--interval-s", "1", "--burst-s", "0.5", "-v"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        out, err = Lines(watch.stdout), Lines(watch.stderr)
        restarted: subprocess.Popen[bytes] | None = None
        try:
            err.wait_for(r"watching ct every 1 s .*notifying 1 target")
            time.sleep(2.5)  # a few reachable polls: the watch knows the run as running
            assert watch.poll() is None and out.lines == [], out.lines
            stop_sshd(sd)
            step_down = last_step(run_dir)
            out.wait_for(r" ct unreachable: unreachable since ")
            wait_until(lambda: len(rx.received) >= 1, "the unreachable notification")
            restarted = start_sshd(sd)
            out.wait_for(r" ct recovered \(unreachable\): reachable again after ")
            capsys.readouterr()
            assert cli_main([*args, "status", "ct", "--json"]) == 0
            st = json.loads(capsys.readouterr().out)[0]
            assert st["state"] in {"running", "stopped"} and st["step"] > step_down, st
            out.wait_for(r" ct finished: at step \d+")
            wait_until(lambda: len(rx.received) >= 3, "three notifications")
            watch.send_signal(signal.SIGTERM)
            assert budget.wait(watch, "the watch to exit after SIGTERM") == 0
            err.wait_for(r"stopped; all 3 notification\(s\) handed over were processed")
        finally:
            if watch.poll() is None:
                watch.kill()
                watch.wait(10)
            if restarted is not None:
                restarted.terminate()
                restarted.wait(10)
        kinds = [re.sub(r"^\S+ ct ([a-z-]+).*", r"\1", ln) for ln in out.lines]
        assert kinds == ["unreachable", "recovered", "finished"], out.lines
        titles = [r["title"] for r in rx.received]
        assert titles == [
            "dflash ct: unreachable",
            "dflash ct: recovered (unreachable)",
            "dflash ct: finished",
        ], rx.received
        assert rx.received[2]["type"] == "success" and rx.received[0]["type"] == "warning"
        assert SECRET not in "\n".join(err.lines)
        said = "\n".join(err.lines)
        assert "dflashctl: ct: poll failed: " in said  # -v: why, once per outage and reason
        assert "notification 'dflash ct: finished': delivered to 1 target(s), failed for 0" in said


async def test_a_receiver_that_is_down_does_not_stop_the_watch(
    real_parts: P.Parts,
    clean_workdir: Path,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two hosts: one behind a closed port (unreachable at once), one real. The receiver is down
    for the first alert (retried, logged redacted, dropped); then it comes up, the real host's
    run crashes, and that message arrives once while the watch keeps running."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        rx_port, dead_port = s.getsockname()[1], P.free_port()
    urls = write_urls(tmp_path, f"json://127.0.0.1:{rx_port}/hook/{SECRET}")
    inv_path = inventory(
        real_parts.sshd,
        real_parts.container,
        tmp_path,
        "unreachable_alert_s = 1\n",
        f'\n[hosts.gone]\naddress = "127.0.0.1"\nport = {dead_port}\nctid = 4243\n'
        "connect_timeout = 1\n",
    )
    known = tmp_path / "known_hosts"  # pinned too: the port is closed, nothing else is wrong
    pub = real_parts.sshd.host_pub.read_text().split()
    with known.open("a") as f:
        f.write(f"[127.0.0.1]:{dead_port} {pub[0]} {pub[1]}\n")
    inv = load_inventory(inv_path)
    targets, errors = load_targets(urls)
    assert errors == []
    notifier = Notifier(targets, backoff_s=(0.1,), sleep=time.sleep)
    settings = WatchSettings(
        interval_s=0.5, policy=PolicyConfig(unreachable_alert_s=1, burst_s=0.2), drain_s=10
    )
    lines: list[str] = []
    stop = asyncio.Event()

    async def seen(pattern: str) -> None:
        def there() -> bool:
            assert not task.done(), f"the watch ended: {task}"
            return any(re.search(pattern, ln) for ln in lines)

        await budget.until_async(there, f"a line matching {pattern!r}", every=0.1)

    with caplog.at_level(logging.WARNING, logger="dflashctl.alerts.notify"):
        task = asyncio.create_task(
            run_watch(
                list(inv.hosts.values()),
                settings,
                make_transport=make_transport,
                notifier=notifier,
                stop=stop,
                emit=lines.append,
            )
        )
        await seen(r" gone unreachable: ")
        await budget.until_async(
            lambda: "after 2 attempts; dropped: dflash gone: unreachable" in caplog.text,
            detail=lambda: caplog.text,
        )
        rx = Receiver()
        rx.server.server_close()
        rx.server = ThreadingHTTPServer(("127.0.0.1", rx_port), rx.server.RequestHandlerClass)
        rx.thread = threading.Thread(
            target=rx.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        with serving(rx):
            host = inv.get("ct")
            t = make_transport(host)
            try:
                res = await RunControl(t, host).starter.new_session(["sh", "-c", "exit 1"], {})
                assert res.ok, res.stderr
            finally:
                await t.close()
            await seen(r" ct crashed: exit 1")
            await budget.until_async(lambda: rx.received, "the crash notification")
            assert not task.done()
            stop.set()
            outcome = await asyncio.wait_for(task, budget.left())
    assert [r["title"] for r in rx.received] == ["dflash ct: crashed"]
    assert outcome.abandoned == 0 and outcome.queued == 2
    assert [re.sub(r"^\S+ (\S+ \S+).*", r"\1", ln) for ln in lines] == [
        "gone unreachable:",
        "ct crashed:",
    ]
    assert "attempt 1 of 2" in caplog.text and "line 2 (json)" in caplog.text
    assert SECRET not in caplog.text and str(rx_port) not in caplog.text


async def test_a_container_without_nvidia_smi_has_no_gpu_events_and_no_error_spam(
    ssh_host: HostConfig, clean_workdir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    poller = HostPoller(ssh_host, make_transport)
    try:
        with caplog.at_level(logging.DEBUG, logger="dflashctl"):
            results = [await poller.poll() for _ in range(3)]
    finally:
        await poller.close()
    assert [r.snapshot.reachable for r in results] == [True] * 3
    assert [r.gpu for r in results] == [()] * 3
    assert caplog.records == []


async def test_gpu_health_readings_become_watch_events_once_per_change(tmp_path: Path) -> None:
    """nvidia-smi replaying captured outputs of a pre-535 driver (it refuses the 535+ field
    names, so the poller falls back to the legacy ones): the throttle reasons that turn on are
    events at the first reading, an unchanged reading is none, and their end is "cleared"."""
    fix = Path(__file__).parent / "fixtures" / "gpu-health"
    legacy = (fix / "a100x2-driver470-legacy.csv").read_text()
    calm = tmp_path / "calm.csv"
    calm.write_text(
        legacy.replace("0x0000000000000080", "0x0000000000000000").replace(" Active", " Not Active")
        .replace("Not Not Active", "Not Active")
    )  # fmt: skip
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    tool = bin_dir / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        f'case "$*" in *clocks_event_reasons*) cat {fix / "driver470-unknown-field.stderr"} >&2;'
        " exit 2;; esac\n"
        f"n=$(cat {tmp_path / 'count'} 2>/dev/null || echo 0); echo $((n + 1)) > {tmp_path / 'count'}\n"
        f'if [ "$n" -ge 2 ]; then cat {calm}; else cat {fix / "a100x2-driver470-legacy.csv"}; fi\n'
    )
    tool.chmod(0o755)
    host = local_host("gpu-node", tmp_path / "wd", python=sys.executable, session="dflt-watch-gpu")
    (tmp_path / "wd").mkdir()
    transport = LocalTransport(env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    poller = HostPoller(host, lambda _h: transport)
    try:
        rounds = [await poller.poll() for _ in range(3)]
    finally:
        await poller.close()
    assert all(r.snapshot.reachable for r in rounds)
    first, second, third = ([(e.kind.value, e.detail) for e in r.gpu] for r in rounds)
    assert first and {k for k, _ in first} == {"gpu-throttled"}
    assert all(d.startswith("GPU 0: ") for _, d in first), first
    assert second == []
    assert [k for k, _ in third] == ["gpu-cleared"] * len(first)
    lines = [format_event_line(e) for e in rounds[0].gpu]
    assert all(" gpu-node gpu-throttled: GPU 0: " in ln for ln in lines), lines


async def test_stop_abandons_what_the_drain_bound_cannot_send(tmp_path: Path) -> None:
    """A push service that never answers: the stop returns after the drain bound and counts the
    notification it abandoned (its retry was still waiting), instead of hanging on it."""
    urls = write_urls(tmp_path, f"json://127.0.0.1:{P.free_port()}/hook/{SECRET}")
    inv_path = tmp_path / "hosts.toml"
    inv_path.write_text(
        f'unreachable_alert_s = 0.5\n[defaults]\nknown_hosts = "{tmp_path / "kh"}"\n'
        f'[hosts.gone]\naddress = "127.0.0.1"\nport = {P.free_port()}\nctid = 200\n'
        "connect_timeout = 1\n"
    )
    targets, _ = load_targets(urls)
    lines: list[str] = []
    stop = asyncio.Event()
    task = asyncio.create_task(
        run_watch(
            list(load_inventory(inv_path).hosts.values()),
            WatchSettings(
                interval_s=0.5,
                policy=PolicyConfig(unreachable_alert_s=0.5, burst_s=0.1),
                drain_s=0.5,
            ),
            make_transport=make_transport,
            notifier=Notifier(targets, backoff_s=(3600,)),
            stop=stop,
            emit=lines.append,
        )
    )

    def emitted() -> list[str]:
        assert not task.done(), task
        return lines

    await budget.until_async(emitted, "a line from the watch")
    stop.set()  # the burst window's event is handed over now, or by the stop's flush
    outcome = await asyncio.wait_for(task, budget.left())
    assert " gone unreachable: " in lines[0]
    assert (outcome.queued, outcome.abandoned) == (1, 1)
    assert outcome.summary(0.5) == (
        "stopped; abandoned 1 of 1 notification(s) still queued after 0.5 s"
    )


async def test_new_xid_lines_in_the_node_kernel_log_are_events_once(tmp_path: Path) -> None:
    """The node's journalctl replaying a captured kernel log: the first read is history, a new
    Xid line is one gpu-error naming the GPU by its bus id, and re-reading it is nothing."""
    fix = Path(__file__).parent / "fixtures" / "gpu-health"
    log = tmp_path / "kernel.log"
    log.write_text((fix / "journalctl-xid.txt").read_text())
    bus = "00000000:9A:00.0"  # the Xids' GPU, as nvidia-smi names it
    smi = tmp_path / "smi.csv"
    smi.write_text(
        f"0, {bus}, Enabled, 0, 0, 0, 0x0000000000000000, Not Active, Not Active, Not Active,"
        " Not Active, Not Active\n"
    )
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in {"nvidia-smi": f"cat {smi}\n", "journalctl": f"cat {log}\n"}.items():
        tool = bin_dir / name
        tool.write_text("#!/bin/sh\n" + text)
        tool.chmod(0o755)
    host = local_host("gpu-node", tmp_path / "wd", python=sys.executable, session="dflt-watch-xid")
    (tmp_path / "wd").mkdir()
    transport = LocalTransport(env={"PATH": f"{bin_dir}:{os.environ['PATH']}"})
    poller = HostPoller(host, lambda _h: transport)
    new_line = (
        "2026-11-30T04:00:01+0000 gpu-node-1 kernel: NVRM: Xid (PCI:0000:9a:00): 79, pid=41233,"
        " name=python, GPU has fallen off the bus.\n"
    )
    try:
        history = await poller.poll()
        with log.open("a") as fh:
            fh.write(new_line)
        fresh = await poller.poll()
        again = await poller.poll()
    finally:
        await poller.close()
    assert history.gpu == () and again.gpu == ()
    assert [(e.kind.value, e.detail) for e in fresh.gpu] == [
        ("gpu-error", "GPU 0: Xid 79 (GPU has fallen off the bus), process python (pid 41233):"
         " GPU has fallen off the bus.")
    ]  # fmt: skip
