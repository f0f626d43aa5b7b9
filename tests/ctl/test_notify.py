"""Notifications through apprise to a real HTTP receiver on 127.0.0.1 (no mocks)."""

from __future__ import annotations

import json
import logging
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dflashctl.alerts.events import Condition, HostSnapshot
from dflashctl.alerts.notify import Notifier, NotifyConfigError, load_targets
from dflashctl.alerts.policy import Notification, PolicyConfig, PolicyState, plan_round

SECRET = "tok3n-s3cret-XYZ"


class Receiver:
    """A webhook endpoint: records every JSON body it accepts; refuses the first `fail_first`."""

    def __init__(self, fail_first: int = 0) -> None:
        self.fail_first = fail_first
        self.requests = 0
        self.received: list[dict[str, Any]] = []
        self.paths: list[str] = []
        rx = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                rx.requests += 1
                if rx.requests <= rx.fail_first:
                    self.send_response(503)
                    self.end_headers()
                    return
                rx.received.append(json.loads(body))
                rx.paths.append(self.path)
                self.send_response(200)
                self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )

    def url(self) -> str:
        return f"json://127.0.0.1:{self.port}/hook/{SECRET}"


@pytest.fixture
def receiver(request: pytest.FixtureRequest) -> Iterator[Receiver]:
    rx = Receiver(getattr(request, "param", 0))
    rx.thread.start()
    yield rx
    rx.server.shutdown()
    rx.server.server_close()
    rx.thread.join(5)


def urls_file(tmp_path: Path, text: str, mode: int = 0o600) -> Path:
    p = tmp_path / "notify-urls"
    p.write_text(text)
    p.chmod(mode)
    return p


def note(title: str) -> Notification:
    return Notification(title, f"body of {title}", "failure", ())


class Sleeps:
    def __init__(self) -> None:
        self.waits: list[float] = []

    def __call__(self, s: float) -> None:
        self.waits.append(s)


def test_each_message_arrives_once_and_in_order(receiver: Receiver, tmp_path: Path) -> None:
    targets, errors = load_targets(urls_file(tmp_path, f"# team hook\n\n{receiver.url()}\n"))
    assert errors == [] and [t.line for t in targets] == [3]
    notifier = Notifier(targets, sleep=Sleeps())
    for i in range(5):
        assert notifier.send(note(f"n{i}")).ok
    assert [r["title"] for r in receiver.received] == [f"n{i}" for i in range(5)]
    assert receiver.received[0]["message"] == "body of n0"
    assert receiver.received[0]["type"] == "failure"
    assert receiver.paths == [f"/hook/{SECRET}"] * 5


@pytest.mark.parametrize("receiver", [2], indirect=True)
def test_a_failing_receiver_gets_it_after_retries(
    receiver: Receiver, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    targets, _ = load_targets(urls_file(tmp_path, receiver.url() + "\n"))
    sleeps = Sleeps()
    with caplog.at_level(logging.DEBUG):
        report = Notifier(targets, backoff_s=(1, 4, 16), sleep=sleeps).send(note("late"))
    assert report.ok and report.attempts == 3
    assert receiver.requests == 3 and [r["title"] for r in receiver.received] == ["late"]
    assert sleeps.waits == [1, 4]  # backoff grows per attempt
    assert "attempt 1 of 4" in caplog.text and "line 1 (json)" in caplog.text
    assert SECRET not in caplog.text and str(receiver.port) not in caplog.text


def test_a_dead_receiver_never_raises_and_is_logged_redacted(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    path = urls_file(tmp_path, f"json://127.0.0.1:{port}/x/{SECRET}\n")
    targets, _ = load_targets(path)
    sleeps = Sleeps()
    with caplog.at_level(logging.DEBUG):
        report = Notifier(targets, sleep=sleeps).send(note("lost"))
    assert not report.ok and report.failed == (f"{path} line 1 (json)",)
    assert report.attempts == 4 and sleeps.waits == [2.0, 8.0, 30.0]
    assert "after 4 attempts; dropped: lost" in caplog.text
    out = capsys.readouterr()
    for text in (caplog.text, out.out, out.err):
        assert SECRET not in text and str(port) not in text


def test_one_dead_target_does_not_keep_the_message_from_the_others(
    receiver: Receiver, tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = s.getsockname()[1]
    text = f"json://127.0.0.1:{dead}/x\n{receiver.url()}\n"
    targets, _ = load_targets(urls_file(tmp_path, text))
    report = Notifier(targets, backoff_s=(0,), sleep=Sleeps()).send(note("both"))
    assert [r["title"] for r in receiver.received] == ["both"]
    assert len(report.delivered) == 1 and len(report.failed) == 1


def test_a_receiver_that_hangs_up_mid_request_is_a_failure_not_a_crash(tmp_path: Path) -> None:
    """A proxy or a restarting service that accepts and closes without answering."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    port = srv.getsockname()[1]
    srv.settimeout(0.1)
    accepted: list[int] = []
    done = threading.Event()

    def hang_up() -> None:
        while not done.is_set():
            try:
                conn, _ = srv.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.recv(65536)
            accepted.append(1)
            conn.close()

    t = threading.Thread(target=hang_up, daemon=True)
    t.start()
    try:
        targets, _ = load_targets(urls_file(tmp_path, f"json://127.0.0.1:{port}/h/{SECRET}\n"))
        report = Notifier(targets, backoff_s=(0, 0), sleep=Sleeps()).send(note("cut"))
    finally:
        done.set()
        t.join(5)
        srv.close()
    assert not report.ok and report.attempts == 3 and len(accepted) == 3


def test_file_errors_name_the_file_and_line_never_the_url(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]
) -> None:
    text = f"json://127.0.0.1:1/ok\nnot a url {SECRET}\nnosuchservice://{SECRET}@x/y\n"
    with caplog.at_level(logging.DEBUG):
        targets, errors = load_targets(urls_file(tmp_path, text))
    out = capsys.readouterr()
    assert SECRET not in caplog.text + out.out + out.err
    assert [t.line for t in targets] == [1]
    assert [e.split(": ")[0] for e in errors] == [
        f"{tmp_path / 'notify-urls'} line 2",
        f"{tmp_path / 'notify-urls'} line 3",
    ]
    assert all(SECRET not in e for e in errors)
    assert "nosuchservice://" in errors[1]

    loose = urls_file(tmp_path, "json://127.0.0.1:1/ok\n", mode=0o644)
    with pytest.raises(NotifyConfigError, match=r"mode 0644 .* chmod 600"):
        load_targets(loose)
    with pytest.raises(NotifyConfigError, match="cannot read it"):
        load_targets(tmp_path / "missing")
    with pytest.raises(NotifyConfigError, match="holds no URLs"):
        load_targets(urls_file(tmp_path, "# nothing yet\n"))


def test_watch_round_trip_burst_is_summarised_and_recovered_follows(
    receiver: Receiver, tmp_path: Path
) -> None:
    """Polls -> policy -> the sender task -> the receiver: one summary, then one recovery."""
    targets, _ = load_targets(urls_file(tmp_path, receiver.url() + "\n"))
    notifier = Notifier(targets, sleep=Sleeps())
    cfg = PolicyConfig(unreachable_alert_s=60, burst_s=30, summarize_at=3)
    hosts = [f"gpu{i}" for i in range(5)]
    t0 = 1_800_000_000.0
    rounds = [
        (t0, [HostSnapshot(h, t0, True, Condition.RUNNING) for h in hosts]),
        (t0 + 10, [HostSnapshot(h, t0 + 10, False) for h in hosts]),
        (t0 + 80, [HostSnapshot(h, t0 + 80, False) for h in hosts]),  # past the grace
        (t0 + 120, [HostSnapshot(h, t0 + 120, False) for h in hosts]),  # window closes
        (t0 + 130, [HostSnapshot("gpu0", t0 + 130, True, Condition.RUNNING)]),
        (t0 + 170, []),
    ]

    state = PolicyState()
    for now, snaps in rounds:  # the watch's worker thread sends each planned note in order
        state, _, notes = plan_round(state, snaps, now, cfg)
        for n in notes:
            assert notifier.send(n).failed == ()
    titles = [r["title"] for r in receiver.received]
    assert titles == [
        "dflash: 5 hosts unreachable (gpu0, gpu1, gpu2, gpu3, gpu4)",
        "dflash gpu0: recovered (unreachable)",
    ]
    assert receiver.received[0]["message"].count("unreachable since") == 5
