"""Remote commands under a hanging `pct`: client-side timeout only vs bounded on the node.

Over real parts on loopback (OpenSSH sshd -> pct shim -> lxc-attach -> LXC container), side by
side in one run, each way on its own connection:

* "client only": what dflashctl did before: wait with a client-side timeout, ask sshd to KILL
  (refused without privilege separation), close the channel.
* "node bound": what SshTransport does now: `timeout -k 3 T` on the node under a guard that
  ends it when its channel closes, and channel slots.

For COMMANDS commands with a TIMEOUT_S limit while every `pct` hangs: how many timed out, how
many were refused a channel (sshd MaxSessions), how many processes were left on the node
SETTLE_S after the last one returned. Then the cost of the bound on a healthy node: the round
trip of `true` without and with the `timeout` wrapper, interleaved.

Run: .venv/bin/python benchmarks/bench_remote.py   (root; needs sshd, lxc; ~1 minute)
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from pathlib import Path

import asyncssh

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from dflashctl.config.inventory import load_inventory  # noqa: E402
from dflashctl.remote import CommandTimeout, TransportError  # noqa: E402
from dflashctl.remote.commands import clean_env, pct_exec, shell_join  # noqa: E402
from dflashctl.remote.ssh import SshTransport  # noqa: E402
from tests.ctl import parts as P  # noqa: E402

COMMANDS = 20
TIMEOUT_S = 1.0
SETTLE_S = 2.0
HANG_S = 7791  # the hung pct's `sleep`, unique enough to count on this machine
ROUND_TRIPS = 40


async def client_only(transport: SshTransport, argv: list[str]) -> str:
    """The old way: client-side timeout, KILL request, close."""
    conn = await transport._connection()
    command = shell_join(pct_exec(transport.host.ctid, clean_env(argv)))
    proc = None
    try:
        proc = await conn.create_process(command, encoding=None)
        await asyncio.wait_for(proc.wait(), TIMEOUT_S)
        return "answered"
    except TimeoutError:
        return "timed out"
    except asyncssh.ChannelOpenError:
        return "refused"
    finally:
        if proc is not None and proc.exit_status is None:
            with contextlib.suppress(OSError, asyncssh.Error):
                proc.send_signal("KILL")
            proc.close()


async def node_bound(transport: SshTransport, argv: list[str]) -> str:
    try:
        await transport.run(argv, timeout=TIMEOUT_S)
        return "answered"
    except CommandTimeout:
        return "timed out"
    except TransportError as err:
        return "refused" if "refused" in str(err) else f"error: {err}"


async def sweep(transport: SshTransport, way: object) -> dict[str, int]:
    outcomes = await asyncio.gather(*(way(transport, ["true"]) for _ in range(COMMANDS)))  # type: ignore[operator]
    await asyncio.sleep(SETTLE_S)
    left = len(P.node_processes(f"sleep {HANG_S}"))
    return {
        "timed out": outcomes.count("timed out"),
        "refused": outcomes.count("refused"),
        "left": left,
    }


async def round_trips(transport: SshTransport) -> tuple[float, float]:
    conn = await transport._connection()
    raw = shell_join(pct_exec(transport.host.ctid, clean_env(["true"])))
    plain: list[float] = []
    bounded: list[float] = []
    for _ in range(ROUND_TRIPS):
        t0 = time.perf_counter()
        await conn.run(raw, check=True)
        t1 = time.perf_counter()
        await transport.run(["true"])
        t2 = time.perf_counter()
        plain.append(t1 - t0)
        bounded.append(t2 - t1)
    return statistics.median(plain), statistics.median(bounded)


async def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="dflt-bench-remote-"))
    try:
        with P.real_parts(root) as parts:
            known = root / "known_hosts"
            pub = parts.sshd.host_pub.read_text().split()
            known.write_text(f"[127.0.0.1]:{parts.sshd.port} {pub[0]} {pub[1]}\n")
            inv = root / "hosts.toml"
            inv.write_text(P.hosts_toml(parts, known_hosts=known))
            host = load_inventory(inv).get("ct")
            rows = []
            for name, way in (("client only (before)", client_only), ("node bound", node_bound)):
                transport = SshTransport(host)
                await transport.run(["true"])  # connect outside the measurement
                with P.hanging_pct(parts.sshd, HANG_S):
                    figures = await sweep(transport, way)
                for line in P.node_processes(f"sleep {HANG_S}"):
                    # what the old way left behind: ours, by pid
                    with contextlib.suppress(ProcessLookupError, ValueError):
                        os.kill(int(line.split()[0]), signal.SIGKILL)
                await transport.close()
                rows.append((name, figures))
            transport = SshTransport(host)
            plain, bounded = await round_trips(transport)
            await transport.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(
        f"{COMMANDS} commands at once, {TIMEOUT_S:g} s limit, every pct hanging; "
        f"node processes counted {SETTLE_S:g} s after the last returned"
    )
    print("| way | timed out | refused a channel | hung pct processes left on the node |")
    print("|---|---|---|---|")
    for name, f in rows:
        print(f"| {name} | {f['timed out']} | {f['refused']} | {f['left']} |")
    print(
        f"\nround trip of `true` (median of {ROUND_TRIPS}, interleaved): plain {plain * 1e3:.1f} ms,"
        f" node-bound {bounded * 1e3:.1f} ms (ratio {bounded / plain:.2f})"
    )


if __name__ == "__main__":
    asyncio.run(main())
