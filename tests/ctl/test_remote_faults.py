"""Remote faults on the real parts: a hanging `pct`, hung container commands, the node's
session limit, hostile env values through real tmux, unusable local SSH setup, a node whose
host key type changed, a frozen container.

The "node" is this machine behind the loopback sshd, so `ps` here is `ps` on the node.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import asyncssh
import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.inventory import HostConfig, load_inventory
from dflashctl.releases.deploy import deploy
from dflashctl.releases.release import Release
from dflashctl.remote import CommandTimeout, HostKeyError
from dflashctl.remote.ssh import SshTransport
from dflashctl.runs.control import RunControl
from dflashctl.runs.follow import Connected, FollowEvent, Line, lines_of
from dflashctl.runs.snapshot import RunStatus
from tests import budget
from tests.ctl import parts as P

pytestmark = [pytest.mark.parts, pytest.mark.timeout(180)]


def in_container(parts: P.Parts, *argv: str) -> str:
    return subprocess.run(
        ["lxc-attach", "-n", parts.container.name, "--", *argv],
        capture_output=True,
        text=True,
        check=False,
    ).stdout


async def settle(probe: Callable[[], object], what: str) -> None:
    """Wait (within the test's budget) until `probe()` is empty: a killed process takes a moment
    to be reaped."""
    await budget.until_async(lambda: not probe(), what, every=0.1, detail=lambda: str(probe()))


def inventory_with(parts: P.Parts, d: Path, *extra: str) -> Path:
    """hosts.toml for the real parts (key pinned), with extra lines in the host's table."""
    known = d / "known_hosts"
    pub = parts.sshd.host_pub.read_text().split()
    known.write_text(f"[127.0.0.1]:{parts.sshd.port} {pub[0]} {pub[1]}\n")
    inv = d / "hosts.toml"
    inv.write_text(P.hosts_toml(parts, known_hosts=known) + "".join(f"{x}\n" for x in extra))
    return inv


# --- item 6: timed-out commands leave nothing behind ----------------------------------------


async def test_a_hanging_pct_leaves_nothing_running_on_the_node(
    real_parts: P.Parts, tmp_path: Path
) -> None:
    """Status under a `pct` that hangs: every call gives up at the inventory's command_timeout
    (not a hard-coded 60 s), says so in words, and no pct or its child survives on the node."""
    host = load_inventory(inventory_with(real_parts, tmp_path, "command_timeout = 1.5")).get("ct")
    shim = str(real_parts.sshd.dir / "bin" / "pct")
    transport = SshTransport(host)
    ctl = RunControl(transport, host)
    try:
        with P.hanging_pct(real_parts.sshd, 7771):
            for _ in range(3):
                st = await ctl.status()
                assert st.state == "unreachable"
                assert st.message == (
                    "status on host ct: no answer within 1.5 s; the remote command was stopped"
                )
            # the GPU pane's query and the log-restart check used their own 30 s before
            with pytest.raises(CommandTimeout, match=r"no answer within 1\.5 s"):
                await ctl.gpus()
            results = await asyncio.gather(
                transport.container_state(),  # first in line for a channel
                *(ctl.status() for _ in range(12)),
                return_exceptions=True,
            )
            pct_status, statuses = results[0], results[1:]
            # 8 channels at once (max_channels); the others wait for one and give up in time
            for got in statuses:
                assert isinstance(got, RunStatus)
                assert got.message in {
                    "status on host ct: no answer within 1.5 s; the remote command was stopped",
                    "status on host ct: not started within 1.5 s: all 8 SSH channels to "
                    "127.0.0.1 are in use (max_channels) by commands still running there",
                }, got.message
            assert isinstance(pct_status, CommandTimeout)
            assert str(pct_status).startswith("pct status 4242 on host ct: no answer within 1.5 s")
            await settle(lambda: P.node_processes("sleep 7771"), "hung pct children left")
            await settle(lambda: P.node_processes(shim), "pct processes left on the node")
        assert (await ctl.status()).state == "stopped"  # the same connection still works
    finally:
        await transport.close()


def test_failures_under_a_hanging_pct_name_the_operation_not_its_status_step(
    real_parts: P.Parts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`logs`, `start` and `stop` read the run's status first; when that hangs, the operator's
    command failed, and the line said "status on host ct: ..." as if `status` had been run."""
    inv = str(inventory_with(real_parts, tmp_path, "command_timeout = 1.5"))
    with P.hanging_pct(real_parts.sshd, 7775):
        for operation in ("logs", "start", "stop"):
            assert cli_main(["--hosts", inv, operation, "ct"]) == 3, operation
            assert capsys.readouterr().err.splitlines() == [
                f"dflashctl: {operation} on host ct: reading the run's status: no answer within "
                "1.5 s; the remote command was stopped"
            ]
        assert cli_main(["--hosts", inv, "status", "ct"]) == 3  # status itself: as it was
        assert "  status on host ct: no answer within 1.5 s" in capsys.readouterr().out


async def test_a_log_stream_under_a_hanging_pct_ends_with_its_channel(
    real_parts: P.Parts, ssh_host: HostConfig
) -> None:
    """A stream has no time bound; closing its channel must still end the pct that never got
    as far as attaching (the container-side guard alone cannot: it never started)."""
    shim = str(real_parts.sshd.dir / "bin" / "pct")
    transport = SshTransport(ssh_host)
    try:
        with P.hanging_pct(real_parts.sshd, 7774):
            stream = lines_of(RunControl(transport, ssh_host).follow(0))
            waiting = asyncio.ensure_future(anext(stream))
            await settle(lambda: not P.node_processes("sleep 7774"), "the stream's pct never ran")
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            await stream.aclose()
            await settle(lambda: P.node_processes("sleep 7774"), "hung pct children left")
            await settle(lambda: P.node_processes(shim), "pct processes left on the node")
    finally:
        await transport.close()


async def test_a_hung_container_command_is_stopped_inside_the_container(
    real_parts: P.Parts, ssh_host: HostConfig
) -> None:
    transport = SshTransport(ssh_host)
    try:
        for _ in range(3):
            with pytest.raises(CommandTimeout) as info:
                await transport.run(["sleep", "7772"], timeout=1)
            assert str(info.value) == (
                "sleep on host ct: no answer within 1 s; the remote command was stopped"
            )
        await settle(
            lambda: [
                p for p in in_container(real_parts, "ps", "-eo", "args").split("\n") if "7772" in p
            ],
            "sleep left in the container",
        )
        await settle(lambda: P.node_processes("lxc-attach.*sleep 7772"), "lxc-attach left")
    finally:
        await transport.close()


async def test_an_abandoned_command_ends_at_once_not_at_its_bound(
    real_parts: P.Parts, ssh_host: HostConfig
) -> None:
    """A caller that gives up early (the TUI's own deadline, Ctrl-C) closes the channel; the
    node-side guard then ends the command right away, in the container and under a hung pct,
    instead of letting it run out its 120 s bound."""
    shim = str(real_parts.sshd.dir / "bin" / "pct")
    transport = SshTransport(ssh_host)
    try:
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(transport.run(["sleep", "7775"], timeout=120), 1)
        await settle(
            lambda: [
                p for p in in_container(real_parts, "ps", "-eo", "args").split("\n") if "7775" in p
            ],
            "abandoned sleep left in the container",
        )
        with P.hanging_pct(real_parts.sshd, 7776):
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(transport.container_state(), 1)
            await settle(lambda: P.node_processes("sleep 7776"), "abandoned pct left")
            await settle(lambda: P.node_processes(shim), "pct processes left on the node")
        assert (await transport.run(["echo", "ok"])).stdout == "ok\n"
    finally:
        await transport.close()


async def test_empty_input_is_a_whole_empty_file(ssh_host: HostConfig, clean_workdir: Path) -> None:
    """b"" is input too: the command gets its end of file (it used to wait for it forever)."""
    from dflashctl.remote.commands import write_file_atomic

    transport = SshTransport(ssh_host)
    try:
        res = await transport.run(write_file_atomic(f"{P.CONTAINER_WORKDIR}/empty"), input=b"")
        assert res.ok and (clean_workdir / "empty").read_bytes() == b""
    finally:
        await transport.close()


async def test_timed_out_commands_never_use_up_the_sessions_of_the_live_log_stream(
    real_parts: P.Parts, ssh_host: HostConfig, clean_workdir: Path
) -> None:
    """One connection carries a `logs -f` stream and rounds of 12 concurrent commands that time
    out (sshd allows 10 sessions per connection): no command is refused a channel, the stream
    never drops, and every line arrives once, in order."""
    log = clean_workdir / "run" / "status.log"
    log.parent.mkdir()
    log.write_text("")
    transport = SshTransport(ssh_host)
    ctl = RunControl(transport, ssh_host)
    links: list[FollowEvent] = []
    got: list[str] = []
    arrived = asyncio.Event()

    async def follow() -> None:
        async for event in ctl.follow(0, delay=lambda a: 0.05):
            if isinstance(event, Line):
                got.append(event.text)
                arrived.set()
            else:
                links.append(event)

    async def lines_up_to(n: int) -> None:
        with log.open("a") as f:
            f.writelines(f"line {i}\n" for i in range(len(got), n))
        while len(got) < n:
            arrived.clear()
            await asyncio.wait_for(arrived.wait(), budget.left())

    follower = asyncio.create_task(follow())
    try:
        await lines_up_to(3)
        for round_ in range(3):
            results = await asyncio.gather(
                *(transport.run(["sleep", "7773"], timeout=1) for _ in range(12)),
                return_exceptions=True,
            )
            assert all(isinstance(r, CommandTimeout) for r in results), results
            stopped = [r for r in results if "the remote command was stopped" in str(r)]
            queued = [r for r in results if "SSH channels to 127.0.0.1 are in use" in str(r)]
            assert len(stopped) + len(queued) == 12 and len(stopped) >= 7  # 8 minus the stream
            await lines_up_to(3 * (round_ + 2))
        assert (await transport.run(["echo", "ok"])).stdout == "ok\n"
        assert got == [f"line {i}" for i in range(12)]
        assert links == [Connected(0)]  # the stream was never lost
    finally:
        follower.cancel()
        with pytest.raises(asyncio.CancelledError):
            await follower
        await transport.close()


# --- item 11: env values with tmux or shell syntax -------------------------------------------

HOSTILE_ENV = {
    "DFLASH_T_SEMI": "a;",
    "DFLASH_T_ALONE": ";",
    "DFLASH_T_ESCAPED": "x \\; y\\;",
    "DFLASH_T_SHELL": "$(touch /tmp/pwned) `id` 'q' \"dq\" & | > <",
    "DFLASH_T_TMUX": "#{session_name} #(id) {a} -e X=1 ; kill-server",
}


async def test_start_passes_env_values_with_tmux_and_shell_syntax_verbatim(
    real_parts: P.Parts,
    standin_release: Release,
    clean_workdir: Path,
    tmp_path: Path,
) -> None:
    """A run started through sshd, pct, LXC and real tmux gets every env value unchanged:
    nothing in the inventory can end the tmux command or reach a shell."""
    table = ", ".join(f"{k} = {json.dumps(v)}" for k, v in HOSTILE_ENV.items())
    host = load_inventory(inventory_with(real_parts, tmp_path, f"env = {{ {table} }}")).get("ct")
    assert {k: host.env[k] for k in HOSTILE_ENV} == HOSTILE_ENV
    transport = SshTransport(host)
    ctl = RunControl(transport, host)
    try:
        await deploy(transport, host, release=standin_release, import_check=False)
        (clean_workdir / "run").mkdir(exist_ok=True)
        (clean_workdir / "run" / "config.toml").write_text("[run]\nname = 'standin'\n")
        started = await ctl.start()
        assert started.started and started.pane_pid
        environ = in_container(real_parts, "cat", f"/proc/{started.pane_pid}/environ")
        env = dict(e.split("=", 1) for e in environ.split("\0") if "=" in e)
        assert {k: env.get(k) for k in HOSTILE_ENV} == HOSTILE_ENV
        sessions = in_container(real_parts, "tmux", "-L", "dflash", "list-sessions", "-F", "#S")
        assert sessions.split() == [host.session]
        assert not (clean_workdir / "pwned").exists() and "pwned" not in in_container(
            real_parts, "ls", "/tmp"
        )
        await ctl.stop(timeout=budget.left())
    finally:
        await transport.close()


# --- item 11: local SSH setup problems are config errors (exit 2) ----------------------------


def test_missing_identity_file_names_the_inventory_and_exits_2(
    real_parts: P.Parts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = inventory_with(real_parts, tmp_path)
    text = inv.read_text().replace(str(real_parts.sshd.client_key), str(tmp_path / "no-such-key"))
    inv.write_text(text)
    expected = f"{inv}: host 'ct': identity_file: {tmp_path / 'no-such-key'} does not exist"
    for command in (["deploy", "ct"], ["start", "ct"], ["stop", "ct"], ["restart", "ct"]):
        assert cli_main(["--hosts", str(inv), *command]) == 2, command
        assert capsys.readouterr().err.strip() == f"dflashctl: {expected}", command
    cli_main(["--hosts", str(inv), "status", "ct"])  # a per-host state there: the same line
    assert expected in capsys.readouterr().out


def test_non_utf8_known_hosts_and_inventory_are_one_line_errors_exit_2(
    real_parts: P.Parts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = inventory_with(real_parts, tmp_path)
    known = tmp_path / "known_hosts"
    known.write_bytes(known.read_bytes()[:12] + b"\xff\xfe" + known.read_bytes()[12:])
    for command in (["deploy", "ct"], ["trust", "ct", "--yes"]):
        assert cli_main(["--hosts", str(inv), *command]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(
            f"dflashctl: {known}: not UTF-8 text at byte 12 (line 1)"
        ), err
    assert cli_main(["--hosts", str(inv), "status", "ct"]) != 0
    assert f"{known}: not UTF-8 text at byte 12" in capsys.readouterr().out
    inv.write_bytes(b"[hosts.ct]\naddress = '\xc3('\n")
    assert cli_main(["--hosts", str(inv), "status"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"dflashctl: {inv}: not UTF-8 text at byte 22 (line 2): invalid continuation byte 0xc3; "
        "save the inventory as UTF-8"
    ]


# --- item 11: a node that now has only another type of host key ------------------------------


@pytest.fixture
def rsa_only_sshd(real_parts: P.Parts, tmp_path: Path) -> Iterator[P.Sshd]:
    with P.sshd(tmp_path / "rsa-sshd", host_key_type="rsa") as sd:
        sd.map_file.write_text(f"{real_parts.container.ctid} {real_parts.container.name}\n")
        yield sd


async def test_rsa_only_node_with_an_ed25519_key_pinned_is_a_key_change(
    rsa_only_sshd: P.Sshd, ssh_host: HostConfig, tmp_path: Path, real_parts: P.Parts
) -> None:
    """asyncssh offers only the pinned key type; a node without it drops the handshake, which
    used to read "Connection lost". It is the host key check failing, and is said so."""
    known = tmp_path / "known_hosts"
    pub = real_parts.sshd.host_pub.read_text().split()  # an ed25519 key, not this node's
    known.write_text(f"[127.0.0.1]:{rsa_only_sshd.port} {pub[0]} {pub[1]}\n")
    host = ssh_host.model_copy(update={"port": rsa_only_sshd.port, "known_hosts": known})
    transport = SshTransport(host)
    try:
        with pytest.raises(HostKeyError) as info:
            await transport.run(["true"])
    finally:
        await transport.close()
    msg = str(info.value)
    assert msg.startswith(f"ct: host key of 127.0.0.1:{rsa_only_sshd.port} CHANGED")
    assert "it now presents a ssh-rsa key SHA256:" in msg and "pinned: ssh-ed25519" in msg


def test_trust_against_a_changed_key_exits_3_as_the_docs_say(
    real_parts: P.Parts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """docs/dflashctl.md: exit 3 is "host unreachable (including an unknown or changed host
    key)", and every command that meets a changed key exits 3; `trust` exited 1."""
    inv = inventory_with(real_parts, tmp_path)
    other = asyncssh.generate_private_key("ssh-ed25519").export_public_key().decode().split()
    known = tmp_path / "known_hosts"  # the node's key replaced (a reinstalled node, or not)
    known.write_text(f"[127.0.0.1]:{real_parts.sshd.port} {other[0]} {other[1]}\n")
    pinned = known.read_text()
    assert cli_main(["--hosts", str(inv), "trust", "ct", "--yes"]) == 3
    err = capsys.readouterr().err
    assert f"ct: a DIFFERENT key is pinned in {known}" in err
    assert known.read_text() == pinned  # nothing added
    assert cli_main(["--hosts", str(inv), "status", "ct"]) == 3  # the same exit, everywhere
    assert "CHANGED from the one pinned" in capsys.readouterr().out


# --- item 11: the pct stand-in and a frozen container ----------------------------------------


async def test_a_frozen_container_is_not_responding_though_the_node_answers(
    real_parts: P.Parts, tmp_path: Path
) -> None:
    """A frozen container (lxc-freeze, `pct suspend`) is running to the node, and `pct exec`
    into it blocks in lxc-attach until it is thawed. Its status said "the node did not report
    it stopped either (link stalled?)", though the link was fine: now it says what the node
    answered and that the container is not responding, and, once the frozen commands hold
    every channel, that the node cannot be asked. The lxc-attach processes wait on the node
    until the container is thawed, then end (docs/dflashctl.md says so)."""
    deadline = asyncio.get_running_loop().time() + 150  # one budget for the whole test
    inv = inventory_with(real_parts, tmp_path, "command_timeout = 2", "max_channels = 2")
    host = load_inventory(inv).get("ct")
    name, attaching = real_parts.container.name, f"lxc-attach -n {real_parts.container.name} "
    transport = SshTransport(host)
    ctl = RunControl(transport, host)
    subprocess.run(["lxc-freeze", "-n", name], check=True)
    try:
        frozen = subprocess.run(["lxc-info", "-n", name, "-sH"], capture_output=True, text=True)
        assert frozen.stdout.strip() == "FROZEN"
        st = await ctl.status()
        assert st.state == "unreachable"
        assert st.message == (
            "status on host ct: no answer within 2 s from container 4242, though the node "
            "answers (`pct status 4242`: running): the container is not responding (frozen? "
            "`pct resume 4242` thaws it); the command waits on the node until the container "
            "runs again"
        )
        assert await transport.container_state() == "running"  # as PVE reports a frozen CT
        assert P.node_processes(attaching), "the blocked lxc-attach is on the node"
        # the first status still holds its channel: this one takes the last, none is left
        st = await ctl.status()
        assert st.message == (
            "status on host ct: no answer within 2 s; all 2 SSH channels are held by commands "
            "that have not ended, so the node cannot be asked about container 4242 (frozen? "
            "`pct resume 4242` thaws it)"
        )
    finally:
        subprocess.run(["lxc-unfreeze", "-n", name], check=True)
    try:
        while P.node_processes(attaching):  # thawed: the blocked commands run and end
            assert asyncio.get_running_loop().time() < deadline, P.node_processes(attaching)
            await asyncio.sleep(0.2)
        assert (await ctl.status()).state != "unreachable"  # the same link, fine all along
    finally:
        await transport.close()
