"""A group's own checks (on top of each node's): the NCCL interface in every container, the
rendezvous port of node 0 reachable from the others, and /dev/infiniband where configured."""

from __future__ import annotations

import asyncio

from dflashctl.config.inventory import GroupConfig, HostConfig
from dflashctl.doctor.checks import Check
from dflashctl.doctor.facts import ContainerFacts
from dflashctl.remote.transport import Transport

LISTEN = r"""
import socket, sys
port, wait, peers = int(sys.argv[1]), float(sys.argv[2]), int(sys.argv[3])
s = socket.socket()
s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    s.bind(("0.0.0.0", port))
except OSError as exc:
    print(f"bind: {exc}", flush=True)
    raise SystemExit(3)
s.listen(16)
s.settimeout(wait)
print("listening", flush=True)
try:
    for _ in range(peers):
        s.accept()[0].close()
except socket.timeout:
    raise SystemExit(4)
"""

CONNECT = r"""
import socket, sys, time
addr, port, wait = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
end = time.monotonic() + wait
while True:
    try:
        socket.create_connection((addr, port), 3).close()
        break
    except OSError as exc:
        if time.monotonic() > end:
            print(f"{exc}", flush=True)
            raise SystemExit(1)
        time.sleep(0.3)
"""


def check_ifname(host: HostConfig, ct: ContainerFacts) -> Check:
    want = host.nccl_socket_ifname
    if want is None:
        return Check("nccl-iface", "ok", "nccl_socket_ifname unset: NCCL picks an interface")
    if want.startswith("^"):
        return Check("nccl-iface", "ok", f"NCCL_SOCKET_IFNAME={want} (an exclusion list)")
    exact = want.startswith("=")
    names = want.removeprefix("=").split(",")
    found = [n for n in names if any((i == n) if exact else i.startswith(n) for i in ct.ifaces)]
    if found:
        return Check("nccl-iface", "ok", f"NCCL_SOCKET_IFNAME={want}: {', '.join(found)} present")
    have = ", ".join(ct.ifaces) or "none"
    return Check(
        "nccl-iface",
        "fail",
        f"NCCL_SOCKET_IFNAME={want}: no such interface in the container (it has {have})",
        (f"set nccl_socket_ifname in hosts.toml [hosts.{host.name}] to one of: {have}",),
    )


def check_infiniband(host: HostConfig, ct: ContainerFacts) -> Check:
    wanted = "NCCL_IB_HCA" in host.env or host.env.get("NCCL_IB_DISABLE") == "0"
    if not wanted:
        return Check("infiniband", "ok", "not configured (no NCCL_IB_HCA in the host's env)")
    if ct.infiniband:
        return Check("infiniband", "ok", f"/dev/infiniband: {', '.join(ct.infiniband)}")
    return Check(
        "infiniband",
        "fail",
        "the host's env asks NCCL for InfiniBand, but the container has no /dev/infiniband",
        (
            "lxc.mount.entry: /dev/infiniband dev/infiniband none bind,optional,create=dir",
            "lxc.cgroup2.devices.allow: c 231:* rwm",
            f"add to /etc/pve/lxc/{host.ctid}.conf on the node, then: pct reboot {host.ctid}",
        ),
    )


async def check_ports(group: GroupConfig, transports: list[Transport]) -> list[Check]:
    """Node 0 listens on the rendezvous port; every other node's container connects to it."""
    head, port = group.nodes[0], group.rdzv_port
    if len(group.nodes) < 2:
        return []
    addr = head.node_address or head.address
    wait = 20.0
    listener = asyncio.ensure_future(
        transports[0].run(
            [head.python, "-c", LISTEN, str(port), str(wait), str(len(group.nodes) - 1)],
            timeout=wait + 15,
        )
    )
    peers = [
        t.run([h.python, "-c", CONNECT, addr, str(port), str(wait)], timeout=wait + 15)
        for h, t in zip(group.nodes[1:], transports[1:], strict=True)
    ]
    results = await asyncio.gather(*peers)
    heard = await listener
    if heard.rc == 3:
        return [
            Check(
                "ports",
                "warn",
                f"{head.name} cannot listen on {port} ({heard.stdout.strip()}): a run may hold it",
            )
        ]
    out = []
    for host, res in zip(group.nodes[1:], results, strict=True):
        if res.ok:
            out.append(Check("ports", "ok", f"{host.name} reaches {addr}:{port} ({head.name})"))
        else:
            out.append(
                Check(
                    "ports",
                    "fail",
                    f"{host.name} cannot reach {addr}:{port} on {head.name}: "
                    f"{res.stdout.strip() or res.error_line()}",
                    (
                        f"open TCP {port} (the group's rdzv_port) and the NCCL ports between "
                        f"the containers, or fix node_address of {head.name} in hosts.toml",
                    ),
                )
            )
    return out
