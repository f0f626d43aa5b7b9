"""dflashctl deploy and log latency, measured side by side in one run.

Over real parts on loopback (OpenSSH sshd -> pct shim -> lxc-attach -> LXC container) and, for
reference, through LocalTransport on this machine:

* full deploy (the repo's trainer tree: hash, tar, preflight, transfer, verify, switch) - time, bytes
* no-change redeploy - time, bytes (must be 0)
* latency from a status line appended to run/status.log by a process in tmux inside the
  container to `RunControl.follow` yielding it (what `logs -f` prints): p50 / p95

Run: .venv/bin/python benchmarks/bench_ctl.py   (root; needs sshd, lxc, tmux; ~1 minute)
"""

from __future__ import annotations

import asyncio
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflashctl.config.inventory import HostConfig, load_inventory, local_host  # noqa: E402
from dflashctl.releases.deploy import deploy  # noqa: E402
from dflashctl.releases.release import build_release  # noqa: E402
from dflashctl.remote import LocalTransport, Transport  # noqa: E402
from dflashctl.remote.commands import tmux, tmux_kill_session  # noqa: E402
from dflashctl.remote.ssh import SshTransport  # noqa: E402
from dflashctl.runs.control import RunControl  # noqa: E402
from dflashctl.runs.follow import Line  # noqa: E402
from tests.ctl import parts as P  # noqa: E402

LINES = 200
INTERVAL = 0.05
# Writes LINES status-shaped lines, each carrying its write time, flushed one by one.
WRITER = r"""
import sys, time
path, n, every = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
time.sleep(1.0)
with open(path, "a", buffering=1) as f:
    for i in range(n):
        f.write(f"[0m] step={i} t={time.time():.6f}\n")
        time.sleep(every)
"""


def pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


async def deploy_figures(transport: Transport, host: HostConfig, tree: Path) -> dict[str, float]:
    rel = build_release(tree)
    t0 = time.perf_counter()
    first = await deploy(transport, host, release=rel)
    t1 = time.perf_counter()
    again = await deploy(transport, host, release=rel)
    t2 = time.perf_counter()
    again_fast = await deploy(transport, host, release=rel, import_check=False)
    t3 = time.perf_counter()
    return {
        "full_s": t1 - t0,
        "full_bytes": first.transferred_bytes,
        "noop_s": t2 - t1,
        "noop_bytes": again.transferred_bytes,
        "noop_meta_s": t3 - t2,
        "noop_meta_bytes": again_fast.transferred_bytes,
    }


async def latency(transport: Transport, host: HostConfig) -> list[float]:
    ctl = RunControl(transport, host)
    log = f"{host.run_dir}/status.log"
    await transport.run(["mkdir", "-p", host.run_dir])
    await transport.run(["rm", "-f", log])
    await transport.run(["touch", log])
    await transport.run(tmux_kill_session("bench"))
    res = await transport.run(
        tmux(
            "new-session",
            "-d",
            "-s",
            "bench",
            host.python,
            "-c",
            WRITER,
            log,
            str(LINES),
            str(INTERVAL),
        )
    )
    assert res.ok, res.stderr
    lags: list[float] = []
    async for event in ctl.follow(0):
        if not isinstance(event, Line):  # Connected / Lost / LogRestarted carry no status line
            continue
        now = time.time()
        lags.append(now - float(event.text.rsplit("t=", 1)[1]))
        if len(lags) == LINES:
            break
    await transport.run(tmux_kill_session("bench"))
    return lags


async def ssh_figures(
    tmp: Path, tree: Path, rows: dict[str, dict[str, float]], lat: dict[str, list[float]]
) -> None:
    with P.real_parts(tmp / "parts") as parts:
        known = tmp / "known_hosts"
        pub = parts.sshd.host_pub.read_text().split()
        known.write_text(f"[127.0.0.1]:{parts.sshd.port} {pub[0]} {pub[1]}\n")
        inv = tmp / "hosts.toml"
        inv.write_text(P.hosts_toml(parts, known_hosts=known))
        host = load_inventory(inv).get("ct")
        ssh = SshTransport(host)
        try:
            rows["ssh+pct+lxc"] = await deploy_figures(ssh, host, tree)
            lat["ssh+pct+lxc"] = await latency(ssh, host)
        finally:
            await ssh.close()


async def main() -> None:
    tree = Path(tempfile.mkdtemp(prefix="bench-ctl-tree-"))
    shutil.copytree(
        REPO / "trainer", tree / "trainer", ignore=shutil.ignore_patterns("__pycache__")
    )
    rows: dict[str, dict[str, float]] = {}
    lat: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-ctl-") as tmp:
        local = LocalTransport(env={"TMUX_TMPDIR": tmp})
        lhost = local_host("local", Path(tmp) / "wd", python=sys.executable)
        rows["local"] = await deploy_figures(local, lhost, tree)
        lat["local"] = await latency(local, lhost)
        await local.run(["tmux", "-L", "dflash", "kill-server"])
        await local.close()

        skipped = P.have("/usr/sbin/sshd", "lxc-create", "tmux")
        if skipped is None:
            try:
                await ssh_figures(Path(tmp), tree, rows, lat)
            except (RuntimeError, OSError) as err:
                skipped = f"real parts did not start: {err}"
    shutil.rmtree(tree, ignore_errors=True)

    print(f"trainer tree: {tree.name} ({rows['local']['full_bytes'] / 1024:.0f} KiB tar)")
    print(
        f"{'path':<14}{'full deploy':>14}{'bytes':>11}{'no-op redeploy':>16}{'bytes':>7}"
        f"{'no-op (metadata)':>18}"
    )
    for name, r in rows.items():
        print(
            f"{name:<14}{r['full_s']:>13.2f}s{r['full_bytes']:>11.0f}{r['noop_s']:>15.2f}s"
            f"{r['noop_bytes']:>7.0f}{r['noop_meta_s']:>17.2f}s"
        )
    print(f"\nstatus line -> follow() latency, {LINES} lines at {1 / INTERVAL:.0f}/s from tmux:")
    for name, xs in lat.items():
        ms = [x * 1000 for x in xs]
        print(
            f"{name:<14} p50 {pct(ms, 50):7.1f} ms   p95 {pct(ms, 95):7.1f} ms   "
            f"max {max(ms):7.1f} ms"
        )
    if skipped:
        print(f"\nssh+pct+lxc figures skipped: {skipped} (needs root, sshd, lxc, tmux)")


if __name__ == "__main__":
    asyncio.run(main())
