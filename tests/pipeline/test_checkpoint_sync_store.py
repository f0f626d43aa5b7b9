"""The one client of torchrun's store (`distributed.launch_store`) and the failed-rank key on it
(`checkpoint_sync.publish_failure` / `published_failure`), against a real TCPStore server in
this process: one error policy (a one-line LaunchStoreError naming MASTER_ADDR:MASTER_PORT),
callers that can do without the store fall back instead of failing a failing run twice."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch._C._distributed_c10d import TCPStore

from tests import budget
from trainer.errors import TrainerError
from trainer.pipeline.checkpoint_sync import (
    FAILED_KEY,
    first_failed_rank,
    publish_failure,
    published_failure,
)
from trainer.pipeline.distributed import LaunchStoreError, World, launch_store


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port  # nothing listens on it any more


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[TCPStore]:
    """torchrun's part: a store server, and the rank's environment pointing at it."""
    store = TCPStore("127.0.0.1", 0, is_master=True, timeout=timedelta(seconds=budget.left()))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(store.port))
    yield store


def test_not_under_torchrun_is_one_line_naming_the_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.delenv("MASTER_PORT", raising=False)
    with pytest.raises(LaunchStoreError, match=r"MASTER_ADDR/MASTER_PORT are not set") as err:
        launch_store()
    assert isinstance(err.value, TrainerError) and "\n" not in err.value.one_line()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "x29500")
    with pytest.raises(LaunchStoreError, match=r"127\.0\.0\.1:x29500: the port is not a number"):
        launch_store()


def test_an_unreachable_store_is_one_line_naming_the_address_within_the_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    port = _closed_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    t0 = time.monotonic()
    with pytest.raises(LaunchStoreError) as err:
        launch_store(timedelta(seconds=1))
    assert time.monotonic() - t0 < 30  # bounded by the timeout (c10d retries once)
    line = err.value.one_line()
    assert line.startswith(f"torchrun's store at MASTER_ADDR:MASTER_PORT = 127.0.0.1:{port} ")
    assert "unreachable within 1 s" in line and "\n" not in line and err.value.hint
    # the failure path never fails for it: its own rank, or unknown
    assert publish_failure(4, wait_s=1) == 4
    assert published_failure(wait_s=1) is None


def test_the_client_reaches_the_launch_store(server: TCPStore) -> None:
    client = launch_store(timedelta(seconds=budget.left()))
    client.set("k", "v")
    assert server.get("k") == b"v"


def test_the_first_published_failure_wins_and_peers_read_it(server: TCPStore) -> None:
    assert published_failure(wait_s=0.5) is None  # nobody failed yet
    assert publish_failure(3) == 3
    assert publish_failure(1) == 3  # a later failure learns the first one
    assert published_failure() == 3
    assert server.get(FAILED_KEY) == b"3"


def test_first_failed_rank_publishes_torchruns_rank_not_the_drafter_rank(
    server: TCPStore,
) -> None:
    """M:N: drafter 1 on node 1 of 2 x (1 drafter + 1 target) is torchrun's rank 2."""
    drafter = World(rank=1, size=2, process=2)
    assert first_failed_rank(ValueError("own failure"), drafter) == 2
    peer = World(rank=0, size=2, process=0)
    lost = RuntimeError("[gloo] Connection closed by peer")
    assert first_failed_rank(lost, peer, wait_s=1) == 2
    assert first_failed_rank(ValueError("x"), World()) is None  # one rank: nothing to name
