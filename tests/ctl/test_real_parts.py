"""dflashctl against real parts: OpenSSH sshd, the pct shim, a real LXC container, real tmux.

The trainer here is the stand-in (fast, torch-free); test_e2e.py runs the real one.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from dflashctl.cli.main import main as cli_main
from dflashctl.config.inventory import HostConfig
from dflashctl.releases.deploy import DeployError, deploy
from dflashctl.releases.release import Release
from dflashctl.remote.ssh import SshTransport
from dflashctl.runs.control import RunControl
from dflashctl.runs.follow import lines_of
from tests import budget
from tests.ctl import parts as P

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny-cpu.toml"
pytestmark = [pytest.mark.parts, pytest.mark.timeout(180)]


def in_container(parts: P.Parts, *argv: str) -> str:
    return subprocess.run(
        ["lxc-attach", "-n", parts.container.name, "--", *argv],
        capture_output=True,
        text=True,
        check=False,
    ).stdout


def test_trust_then_hosts_and_status_over_real_sshd(
    real_parts: P.Parts, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    inv = tmp_path / "hosts.toml"
    inv.write_text(P.hosts_toml(real_parts, known_hosts=tmp_path / "known_hosts"))
    assert cli_main(["--hosts", str(inv), "status", "ct"]) == 3
    assert "run `dflashctl trust ct` first" in capsys.readouterr().out
    assert cli_main(["--hosts", str(inv), "trust", "ct", "--yes"]) == 0
    pub = real_parts.sshd.host_pub.read_text().split()[1]
    assert pub in (tmp_path / "known_hosts").read_text()
    assert (tmp_path / "known_hosts").stat().st_mode & 0o077 == 0
    capsys.readouterr()
    assert cli_main(["--hosts", str(inv), "hosts"]) == 0
    assert f"reachable, CT {real_parts.container.ctid} running" in capsys.readouterr().out


async def test_deploy_preflight_and_noop_redeploy(
    ssh_host: HostConfig, standin_release: Release, clean_workdir: Path
) -> None:
    transport = SshTransport(ssh_host)
    try:
        first = await deploy(transport, ssh_host, release=standin_release)  # real torch import
        assert "torch=" in first.preflight.summary() and first.preflight.python
        assert first.transferred_bytes == len(standin_release.tar)
        rel_dir = clean_workdir / "releases" / standin_release.id
        assert (rel_dir / ".complete").is_file() and (rel_dir / "trainer" / "__main__.py").is_file()
        assert os.readlink(clean_workdir / "current") == f"releases/{standin_release.id}"
        again = await deploy(transport, ssh_host, release=standin_release, import_check=False)
        assert again.transferred_bytes == 0 and not again.switched
    finally:
        await transport.close()


async def test_a_first_deploy_with_a_config_says_nothing_about_checkpoints(
    ssh_host: HostConfig, standin_release: Release, clean_workdir: Path
) -> None:
    """A container whose workdir does not exist yet has no checkpoints: the resume check says
    nothing (it said "could not read the checkpoints' config" on every first deploy)."""
    host = ssh_host.model_copy(update={"workdir": f"{P.CONTAINER_WORKDIR}/fresh"})
    said: list[str] = []
    transport = SshTransport(host)
    try:
        await deploy(transport, host, release=standin_release, config=TINY, progress=said.append)
    finally:
        await transport.close()
    assert (clean_workdir / "fresh" / "run" / "config.toml").read_text() == TINY.read_text()
    assert not [line for line in said if "checkpoint" in line], said


async def test_stopped_container_is_refused_before_anything_is_sent(
    real_parts: P.Parts, ssh_host: HostConfig, standin_release: Release
) -> None:
    with real_parts.sshd.map_file.open("a") as f:
        f.write("4243 dflt-never-created\n")
    host = ssh_host.model_copy(update={"ctid": 4243, "name": "gone"})
    transport = SshTransport(host)
    try:
        with pytest.raises(DeployError, match=r"gone: container 4243 is stopped, not running"):
            await deploy(transport, host, release=standin_release)
    finally:
        await transport.close()


async def test_run_control_over_ssh_pct_and_tmux(
    real_parts: P.Parts,
    ssh_host: HostConfig,
    standin_release: Release,
    clean_workdir: Path,
    tmp_path: Path,
) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("[run]\nname = 'standin'\n")
    transport = SshTransport(ssh_host)
    ctl = RunControl(transport, ssh_host)
    try:
        await deploy(transport, ssh_host, release=standin_release, import_check=False)
        (clean_workdir / "run").mkdir(exist_ok=True)
        (clean_workdir / "run" / "config.toml").write_bytes(cfg.read_bytes())
        started = await ctl.start()
        assert started.started and started.pane_pid
        # the pane really is wide, on the private socket, under the exact session name
        listing = in_container(
            real_parts,
            "tmux",
            "-L",
            "dflash",
            "list-panes",
            "-a",
            "-F",
            "#{session_name} #{pane_width}",
        )
        assert listing.split() == [ssh_host.session, "250"]

        async def at_step_3() -> bool:
            return ((await ctl.status()).step or 0) >= 3

        await budget.until_awaited(at_step_3, every=0.2)
        st = await ctl.status()
        assert st.state == "running" and st.step is not None and st.step >= 3
        assert st.run_release == standin_release.id

        got: list[str] = []
        async for line in lines_of(ctl.follow(0)):
            got.append(line)
            if len(got) == 4:
                break
        assert got[0] == "Starting pipeline..." and got[3].startswith("[0m] step=2 ")

        # closing the stream killed the helper inside the container
        def tail_gone() -> list[str] | None:
            procs = in_container(real_parts, "ps", "-eo", "comm").split()
            return None if "tail" in procs else procs

        # (async: closing the stream ends its helper on this event loop)
        assert "ps" in await budget.until_async(tail_gone, every=0.2)

        stop = await ctl.stop(timeout=budget.left())
        assert stop.checkpoint is not None and stop.checkpoint.step >= 3
        assert (clean_workdir / stop.checkpoint.path).is_file()
        assert (await ctl.status()).state == "stopped"
    finally:
        await transport.close()


def test_status_json_and_logs_via_cli(
    ssh_host: HostConfig,
    standin_release: Release,
    clean_workdir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    run = clean_workdir / "run"
    run.mkdir()
    (run / "status.log").write_text(
        "Starting pipeline...\n[5m] step=42 loss=1.0000 acc=0.500 streak=1.0 lr=1.00e-04 "
        "noise=0.1000 | tgt=1.00b/s dft=1.00b/s (2.0Ktok/s) | q_pre=[1] q_hs=[1] | epoch~0.10 "
        "ETA=4.2h\n"
    )
    inv = ["--hosts", str(ssh_host.known_hosts.parent / "hosts.toml")]
    assert cli_main([*inv, "status", "ct", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data[0]["state"] == "stopped" and data[0]["step"] == 42
    assert cli_main([*inv, "logs", "ct", "-n", "1", "--json"]) == 0
    ev = json.loads(capsys.readouterr().out)
    assert ev["kind"] == "status" and ev["eta_s"] == pytest.approx(4.2 * 3600)
    assert cli_main([*inv, "attach", "ct", "--print"]) == 0
    line = capsys.readouterr().out
    assert "StrictHostKeyChecking=yes" in line and "attach-session -t =dflash-test" in line


async def test_pct_shim_push_status_and_stopped_container_messages(
    real_parts: P.Parts, ssh_host: HostConfig, clean_workdir: Path, tmp_path: Path
) -> None:
    """The shim keeps Proxmox's syntax and error texts, which dflashctl's messages rely on."""
    src = tmp_path / "note.txt"
    src.write_text("pushed\n")
    transport = SshTransport(ssh_host)
    try:
        ctid = ssh_host.ctid
        res = await transport.run_host(
            ["pct", "push", str(ctid), str(src), f"{P.CONTAINER_WORKDIR}/n"]
        )
        assert res.ok and (clean_workdir / "n").read_text() == "pushed\n"
        assert (await transport.run_host(["pct", "status", "99999"])).rc != 0
        gone = ssh_host.model_copy(update={"ctid": 4243, "name": "gone"})
        with real_parts.sshd.map_file.open("a") as f:
            f.write("4243 dflt-never-created\n")
        gone_transport = SshTransport(gone)
        st = await RunControl(gone_transport, gone).status()
        await gone_transport.close()
        assert st.state == "unreachable"
        assert st.message == "gone: container 4243 is not running (pct start 4243)"
    finally:
        await transport.close()
