"""Fault injection with an in-process asyncssh server standing in for a Proxmox node.

Only faults a real sshd cannot be told to produce on cue live here: a link dropped mid-follow
(with a half-sent line), a peer too slow to answer, a changed host key, hostile names.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh
import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.inventory import HostConfig, load_inventory
from dflashctl.remote import CommandTimeout, HostKeyError, HostUnreachable, TransportError
from dflashctl.remote.commands import BASE_ENV
from dflashctl.remote.ssh import SshTransport, pin_host_key
from dflashctl.runs.control import RunControl
from dflashctl.runs.follow import FollowEvent, Line, LogRestarted, Lost, lines_of
from tests import budget

pytestmark = pytest.mark.timeout(60)


@dataclass
class FakePve:
    """Speaks just enough `pct exec CTID -- env -i ... argv` to inject faults."""

    lines: list[str]
    drop_every: int = 7  # lines per connection before the link "drops"
    slow_s: float = 0.0
    commands: list[str] = field(default_factory=list)
    inner: list[list[str]] = field(default_factory=list)
    tail_starts: list[int] = field(default_factory=list)
    closed: list[str] = field(default_factory=list)

    bounds: list[float] = field(default_factory=list)

    def node_argv(self, command: str) -> list[str]:
        """The command without its node-side bound (`timeout -k K SECONDS`), which is noted.

        Commands are bounded on the node; streams run under the node guard instead.
        """
        argv = shlex.split(command)
        if argv[:2] == ["sh", "-c"] and argv[3:6] == ["dflash-node-stream", "timeout", "0"]:
            return argv[6:]
        if argv[:2] == ["sh", "-c"] and argv[3] == "dflash-node-guard":
            argv = argv[4:]  # the guard watching the channel of a command given no input
        assert argv[:2] == ["timeout", "-k"], argv
        self.bounds.append(float(argv[3]))
        return argv[4:]

    def container_argv(self, command: str) -> list[str]:
        argv = self.node_argv(command)
        assert argv[:2] == ["pct", "exec"] and argv[3] == "--", argv
        rest = argv[4:]
        assert rest[:2] == ["env", "-i"], rest
        rest = rest[2:]
        while rest and "=" in rest[0] and not rest[0].startswith("/"):
            rest = rest[1:]
        return rest

    async def handle(self, process: asyncssh.SSHServerProcess[bytes]) -> None:
        self.commands.append(process.command or "")
        if self.node_argv(process.command or "")[:2] == ["pct", "status"]:
            process.stdout.write(b"status: running\n")
            process.exit(0)
            return
        argv = self.container_argv(process.command or "")
        self.inner.append(argv)
        try:
            if "tail" in argv:
                start = int(argv[argv.index("-n") + 1].lstrip("+")) - 1
                self.tail_starts.append(start)
                for i, line in enumerate(self.lines[start:]):
                    if i == self.drop_every:
                        process.stdout.write(b"half a li")  # never completed: must not show
                        await asyncio.sleep(0.05)
                        process.channel.get_connection().abort()
                        return
                    process.stdout.write(line.encode() + b"\n")
                    await asyncio.sleep(0.005)
                await process.stdin.read()  # like tail -F: until the client goes away
                self.closed.append("tail")
            elif argv[0] == "wc":
                process.stdout.write(f"{len(self.lines)} {argv[-1]}\n".encode())
            elif argv[0] == "argv-echo":
                process.stdout.write(json.dumps(argv[1:]).encode())
            elif argv[0] == "slow":
                try:  # the node's `timeout` ends it at its bound: exit 124, as coreutils does
                    limit = min(self.slow_s, self.bounds[-1])
                    await asyncio.wait_for(process.channel.wait_closed(), limit)
                    self.closed.append("slow")
                    return
                except TimeoutError:
                    if limit < self.slow_s:
                        self.closed.append("slow")
                        process.exit(124)
                        return
                    process.stdout.write(b"late\n")
            process.exit(0)
        except (asyncssh.Error, OSError, asyncio.CancelledError):
            self.closed.append(argv[0])


@dataclass
class Server:
    pve: FakePve
    port: int
    host_key: asyncssh.SSHKey
    client_key_path: Path
    acceptor: asyncssh.SSHAcceptor


async def start_server(tmp: Path, pve: FakePve, host_key: asyncssh.SSHKey | None = None) -> Server:
    client = asyncssh.generate_private_key("ssh-ed25519")
    ckp = tmp / "client_key"
    ckp.write_bytes(client.export_private_key())
    skey = host_key or asyncssh.generate_private_key("ssh-ed25519")
    acceptor = await asyncssh.listen(
        "127.0.0.1",
        0,
        server_host_keys=[skey],
        authorized_client_keys=asyncssh.import_authorized_keys(client.export_public_key().decode()),
        process_factory=pve.handle,
        encoding=None,
    )
    return Server(pve, acceptor.get_port(), skey, ckp, acceptor)


def host_for(tmp: Path, srv: Server, **over: object) -> HostConfig:
    inv = tmp / "hosts.toml"
    inv.write_text(
        f"""[hosts.fake]
address = "127.0.0.1"
port = {srv.port}
ctid = 200
identity_file = "{srv.client_key_path}"
use_agent = false
known_hosts = "{tmp / "known_hosts"}"
connect_timeout = 3
"""
    )
    return load_inventory(inv).get("fake").model_copy(update=over)


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    srv = await start_server(tmp_path, FakePve(lines=[f"line {i}" for i in range(20)]))
    yield srv
    srv.acceptor.close()
    await srv.acceptor.wait_closed()


async def follow_lines(
    server: Server, tmp_path: Path, count: int, each: Callable[[list[str]], None] | None = None
) -> tuple[list[str], list[FollowEvent]]:
    """Follow status.log from line 0 until `count` lines arrive: (lines, link events)."""
    host = host_for(tmp_path, server)
    pin_host_key(host, server.host_key.convert_to_public())
    transport = SshTransport(host)
    links: list[FollowEvent] = []
    got: list[str] = []
    try:
        async for event in RunControl(transport, host).follow(0, delay=lambda attempt: 0.01):
            if not isinstance(event, Line):
                links.append(event)
                continue
            got.append(event.text)
            if each is not None:
                each(got)
            if len(got) == count:
                break
    finally:
        await transport.close()
    return got, links


async def test_follow_survives_drops_without_duplicates_or_losses(
    server: Server, tmp_path: Path
) -> None:
    got, links = await follow_lines(server, tmp_path, 20)
    assert got == [f"line {i}" for i in range(20)]
    assert server.pve.tail_starts == [0, 7, 14]
    assert sum(1 for s in links if isinstance(s, Lost)) == 2


async def test_follow_rereads_a_log_that_started_over(server: Server, tmp_path: Path) -> None:
    """A status.log found shorter on reconnect is read from its first line, not past its end."""

    def replace_log(got: list[str]) -> None:
        if len(got) == 14:  # the link drops after this line; the log is replaced meanwhile
            server.pve.lines = [f"new {i}" for i in range(5)]

    got, links = await follow_lines(server, tmp_path, 19, replace_log)
    assert got == [f"line {i}" for i in range(14)] + [f"new {i}" for i in range(5)]
    assert server.pve.tail_starts == [0, 7, 0]
    assert links.count(LogRestarted()) == 1
    assert [argv[0] for argv in server.pve.inner].count("wc") == 2  # once per reconnect


async def test_follow_resumes_from_a_given_line(server: Server, tmp_path: Path) -> None:
    host = host_for(tmp_path, server)
    pin_host_key(host, server.host_key.convert_to_public())
    transport = SshTransport(host)
    stream = lines_of(RunControl(transport, host).follow(15, delay=lambda a: 0.01))
    got = [await anext(stream) for _ in range(5)]
    await stream.aclose()
    await transport.close()
    assert got == [f"line {i}" for i in range(15, 20)]
    # closing the stream ended the remote helper
    await budget.until_async(
        lambda: server.pve.closed == ["tail"], detail=lambda: str(server.pve.closed)
    )


async def test_slow_peer_times_out_and_the_remote_command_is_closed(
    server: Server, tmp_path: Path
) -> None:
    server.pve.slow_s = 30
    host = host_for(tmp_path, server)
    pin_host_key(host, server.host_key.convert_to_public())
    transport = SshTransport(host)
    with pytest.raises(
        CommandTimeout, match=r"^slow on host fake: no answer within 0.5 s; the remote command"
    ):
        await transport.run(["slow"], timeout=0.5)
    assert 0 < server.pve.bounds[-1] <= 0.5  # the node bounds it to what is left of 0.5 s
    await budget.until_async(
        lambda: server.pve.closed == ["slow"], detail=lambda: str(server.pve.closed)
    )
    # the connection is still usable afterwards
    res = await transport.run(["argv-echo", "ok"], timeout=budget.left())
    assert json.loads(res.stdout) == ["ok"]
    await transport.close()


async def test_hostile_values_arrive_as_exactly_one_argv(server: Server, tmp_path: Path) -> None:
    host = host_for(tmp_path, server)
    pin_host_key(host, server.host_key.convert_to_public())
    transport = SshTransport(host)
    hostile = [
        "a b",
        "; rm -rf /",
        "$(touch /tmp/pwned)",
        "`id`",
        "'single'",
        '"double"',
        "back\\slash",
        "new\nline",
        "*",
        "-rf",
        "",
        "=d",
    ]
    res = await transport.run(["argv-echo", *hostile], timeout=budget.left())
    await transport.close()
    assert json.loads(res.stdout) == hostile
    # and the environment is explicit: nothing but BASE_ENV crosses into the container
    sent = server.pve.node_argv(server.pve.commands[-1])
    assert [a for a in sent[6 : 6 + len(BASE_ENV)]] == [f"{k}={v}" for k, v in BASE_ENV.items()]


async def test_unknown_and_changed_host_keys_are_hard_failures(
    server: Server, tmp_path: Path
) -> None:
    host = host_for(tmp_path, server)
    with pytest.raises(HostKeyError, match=r"no pinned host key .* run `dflashctl trust fake`"):
        await SshTransport(host).run(["argv-echo"], timeout=budget.left())
    pin_host_key(host, asyncssh.generate_private_key("ssh-ed25519").convert_to_public())
    with pytest.raises(HostKeyError, match=r"CHANGED") as info:
        await SshTransport(host).run(["argv-echo"], timeout=budget.left())
    assert isinstance(info.value, HostUnreachable)  # exit code 3 in the CLI
    assert server.pve.commands == []  # no command ever reached the impostor


async def test_trust_pins_once_and_refuses_a_changed_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pve = FakePve(lines=[])
    srv = await start_server(tmp_path, pve)
    host_for(tmp_path, srv)
    inv = str(tmp_path / "hosts.toml")
    rc = await asyncio.to_thread(cli_main, ["--hosts", inv, "trust", "fake", "--yes"])
    out = capsys.readouterr().out
    assert rc == 0 and srv.host_key.get_fingerprint("sha256") in out and "pinned in" in out
    rc = await asyncio.to_thread(cli_main, ["--hosts", inv, "trust", "fake", "--yes"])
    assert rc == 0 and "already pinned" in capsys.readouterr().out
    port = srv.port
    srv.acceptor.close()
    await srv.acceptor.wait_closed()
    # same address and port, new key (a reinstalled host or a man in the middle)
    acceptor = await asyncssh.listen(
        "127.0.0.1", port, server_host_keys=[asyncssh.generate_private_key("ssh-ed25519")]
    )
    try:
        rc = await asyncio.to_thread(cli_main, ["--hosts", inv, "trust", "fake", "--yes"])
        assert rc == 3 and "DIFFERENT key is pinned" in capsys.readouterr().err
        rc = await asyncio.to_thread(cli_main, ["--hosts", inv, "status", "fake"])
        assert rc == 3 and "CHANGED" in capsys.readouterr().out
    finally:
        acceptor.close()
        await acceptor.wait_closed()


async def test_unreachable_host_is_exit_3_and_other_hosts_still_answer(
    server: Server, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    host = host_for(tmp_path, server)
    pin_host_key(host, server.host_key.convert_to_public())
    inv = tmp_path / "hosts.toml"
    dead_port = server.port + 1 if server.port < 65535 else server.port - 1
    inv.write_text(
        inv.read_text()
        + inv.read_text()
        .replace("[hosts.fake]", "[hosts.dead]")
        .replace(f"port = {server.port}", f"port = {dead_port}")
    )
    rc = await asyncio.to_thread(cli_main, ["--hosts", str(inv), "status", "dead"])
    assert rc == 3 and "cannot connect" in capsys.readouterr().out
    rc = await asyncio.to_thread(cli_main, ["--hosts", str(inv), "hosts"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "dead" in out and "UNREACHABLE" in out
    assert "fake" in out and "CT 200 running" in out


async def test_encrypted_identity_file_is_a_clear_error(server: Server, tmp_path: Path) -> None:
    enc = tmp_path / "encrypted_key"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "pw", "-f", str(enc)], check=True)
    host = host_for(tmp_path, server).model_copy(update={"identity_file": enc})
    pin_host_key(host, server.host_key.convert_to_public())
    with pytest.raises(TransportError, match=r"cannot use identity_file .*ssh-agent"):
        await SshTransport(host).run(["argv-echo"], timeout=budget.left())


async def test_trust_answer_no_pins_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import io

    srv = await start_server(tmp_path, FakePve(lines=[]))
    host_for(tmp_path, srv)
    monkeypatch.setattr("sys.stdin", io.StringIO("n\n"))
    try:
        rc = await asyncio.to_thread(
            cli_main, ["--hosts", str(tmp_path / "hosts.toml"), "trust", "fake"]
        )
    finally:
        srv.acceptor.close()
        await srv.acceptor.wait_closed()
    out = capsys.readouterr().out
    assert rc == 1 and "Trust this key? [y/N]" in out and "not trusted" in out
    assert not (tmp_path / "known_hosts").exists()


async def test_follow_does_not_retry_a_host_key_failure(server: Server, tmp_path: Path) -> None:
    host = host_for(tmp_path, server)
    pin_host_key(host, asyncssh.generate_private_key("ssh-ed25519").convert_to_public())
    transport = SshTransport(host)
    with pytest.raises(HostKeyError, match="CHANGED"):
        async for _ in RunControl(transport, host).follow(0, delay=lambda a: 0.01):
            pass
    assert server.pve.commands == []


async def test_logs_follow_says_on_stderr_when_it_reconnects(
    server: Server, tmp_path: Path
) -> None:
    """`dflashctl logs -f` (the real CLI, in its own process) across two dropped links: stdout
    has every line once, stderr says when the link went and when it came back."""
    import sys

    host = host_for(tmp_path, server)
    pin_host_key(host, server.host_key.convert_to_public())
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "dflashctl",
        "--hosts",
        str(tmp_path / "hosts.toml"),
        "logs",
        "fake",
        "-f",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert proc.stdout is not None and proc.stderr is not None
    got: list[str] = []
    try:
        async with asyncio.timeout(budget.left()):
            while len(got) < 20:
                got.append((await proc.stdout.readline()).decode().rstrip("\n"))
    finally:
        proc.terminate()
        err = (await proc.stderr.read()).decode()
        await proc.wait()
    assert got == [f"line {i}" for i in range(20)]
    lost = [ln for ln in err.splitlines() if "; reconnecting" in ln]
    back = [ln for ln in err.splitlines() if ln == "dflashctl: fake: reconnected"]
    assert len(lost) == 2 and len(back) == 2, err
