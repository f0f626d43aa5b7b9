"""Real parts for dflashctl tests and benchmarks: OpenSSH sshd, an LXC container, the pct shim.

Plain context managers (no pytest) so benchmarks reuse exactly what the tests run against. Waits
end on their condition or with the running test's budget (tests/budget.py; outside pytest,
budget.DEFAULT_S), never at a per-step deadline.
The "Proxmox node" is this machine reached through a loopback sshd whose sessions find the
`pct` shim first on PATH; the "CT" is a real LXC container with no network, the repo's venv
and its base interpreter bind-mounted read-only, and a writable workdir bind-mounted from a
host temp dir (so tests can inspect what landed).
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from tests import budget

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SHIM = HERE / "pct"
CONTAINER_WORKDIR = "/srv/dflash"
CTID = 4242
NAME_PREFIX = "dflt-"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _run(argv: list[str], timeout: float | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, check=False, timeout=timeout)


def have(*tools: str) -> str | None:
    """None if all tools exist, else a reason naming the first missing one."""
    for tool in tools:
        if shutil.which(tool) is None and not Path(tool).exists():
            return f"{tool} not installed"
    return None


@dataclass(frozen=True)
class Sshd:
    port: int
    client_key: Path
    host_pub: Path
    dir: Path
    map_file: Path


@contextlib.contextmanager
def sshd(
    base: Path, *, host_key_type: str = "ed25519", node_proc: Path | None = None
) -> Iterator[Sshd]:
    """OpenSSH sshd on 127.0.0.1:<free port>, root login by a temp key, pct shim on PATH.

    `host_key_type` is the node's only host key type (say "rsa", for a node that has no
    ed25519 key). `node_proc`: the node's NVIDIA view, for sessions of this sshd only: sshd
    runs in a mount namespace of its own where `node_proc/devices` is bound over
    /proc/devices and /proc/driver/nvidia is `node_proc/nvidia` (absent: no kernel module),
    so tests rewrite what "the node" reports between calls. `pct config` prints
    `base/pve-lxc/CTID.conf` (`write_ct_conf`).
    """
    base.mkdir(parents=True, exist_ok=True)
    (base / "pve-lxc").mkdir(exist_ok=True)
    shim_dir = base / "bin"
    shim_dir.mkdir(exist_ok=True)
    shutil.copy(SHIM, shim_dir / "pct")
    (shim_dir / "pct").chmod(0o755)
    host_key = base / f"ssh_host_{host_key_type}_key"
    client_key = base / "client_ed25519"
    for key, kind in ((host_key, host_key_type), (client_key, "ed25519")):
        if not key.exists():
            r = _run(["ssh-keygen", "-q", "-t", kind, "-N", "", "-f", str(key)])
            if r.returncode:
                raise RuntimeError(f"ssh-keygen failed: {r.stderr.strip()}")
    auth = base / "authorized_keys"
    auth.write_text((base / "client_ed25519.pub").read_text())
    map_file = base / "pct-map"
    map_file.touch()
    port = free_port()
    cfg = base / "sshd_config"
    cfg.write_text(
        "\n".join(
            [
                f"ListenAddress 127.0.0.1:{port}",
                f"HostKey {host_key}",
                f"AuthorizedKeysFile {auth}",
                f"PidFile {base / 'sshd.pid'}",
                "PermitRootLogin prohibit-password",
                "PasswordAuthentication no",
                "KbdInteractiveAuthentication no",
                "UsePAM no",
                "StrictModes no",
                "AllowAgentForwarding no",
                "X11Forwarding no",
                "LogLevel ERROR",
                f"SetEnv PATH={shim_dir}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
                f" DFLASH_PCT_MAP={map_file}",
                "",
            ]
        )
    )
    Path("/run/sshd").mkdir(parents=True, exist_ok=True)
    argv = ["/usr/sbin/sshd", "-D", "-e", "-f", str(cfg)]
    if node_proc is not None:
        mounts = (
            'mount --bind "$1/devices" /proc/devices && mount -t tmpfs tmpfs /proc/driver && '
            'ln -s "$1/nvidia" /proc/driver/nvidia && shift && exec "$@"'
        )
        argv = ["unshare", "--mount", "--propagation", "private", "--"]
        argv += ["sh", "-c", mounts, "node", str(node_proc), "/usr/sbin/sshd", "-D", "-e"]
        argv += ["-f", str(cfg)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.DEVNULL,
        stderr=open(base / "sshd.log", "ab"),  # noqa: SIM115 - lives as long as sshd
    )

    def listening() -> bool:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd exited: {(base / 'sshd.log').read_text()[-500:]}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1.0):
            return True
        return False

    try:
        budget.until(listening, f"sshd listening on 127.0.0.1:{port}")
        yield Sshd(port, client_key, host_key.with_name(host_key.name + ".pub"), base, map_file)
    finally:
        proc.terminate()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()


@dataclass(frozen=True)
class Container:
    name: str
    ctid: int
    workdir_host: Path  # bind-mounted at CONTAINER_WORKDIR
    python: str


def write_ct_conf(sd: Sshd, ctid: int, text: str) -> Path:
    """The node's /etc/pve/lxc/CTID.conf as the pct shim serves it."""
    path = sd.dir / "pve-lxc" / f"{ctid}.conf"
    path.write_text(text)
    return path


def default_ct_conf(name: str) -> str:
    """A privileged CT's config as PVE writes it, no devices passed through."""
    return (
        f"arch: amd64\ncores: 2\nhostname: {name}\nmemory: 4096\nostype: debian\n"
        f"rootfs: local:{CTID}/vm-{CTID}-disk-0.raw,size=8G\nswap: 512\n"
    )


def _destroy(name: str) -> None:
    """Clean-up: no deadline of its own (a spent budget must not leave the container behind);
    pytest-timeout still bounds the test."""
    _run(["lxc-stop", "-n", name, "-k"])
    _run(["lxc-destroy", "-n", name, "-f"])


def reap_stale_containers() -> None:
    """Destroy dflt-<pid> containers left by test sessions whose process is gone."""
    r = _run(["lxc-ls", "-1"])
    for name in r.stdout.split():
        if not name.startswith(NAME_PREFIX):
            continue
        pid = name[len(NAME_PREFIX) :].split("-")[0]  # dflt-PID or dflt-PID-SUFFIX
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _destroy(name)


@contextlib.contextmanager
def lxc_container(
    workdir_host: Path,
    *,
    name: str | None = None,
    host_network: bool = False,
    workdir: str = CONTAINER_WORKDIR,
    shared: tuple[Path, ...] = (),
    extra_config: tuple[str, ...] = (),
    mounts: tuple[tuple[Path, str], ...] = (),
) -> Iterator[Container]:
    """A running LXC container (template sshd, no network) with the venv visible inside.

    `host_network`: `lxc.net.0.type = none`, the host's network namespace (a group's nodes
    meet on 127.0.0.1); the template's sshd would then bind the host's port 22, so the
    container's init runs `sleep infinity` instead (nothing here uses the container's sshd).
    `workdir`: where the workdir is mounted inside; `shared`: host directories mounted
    read-write at the same path inside (a store both nodes read); `mounts`: (host directory,
    container path) pairs, read-write (a node's own /data); `extra_config`: more LXC config
    lines (device cgroup rules)."""
    reap_stale_containers()
    name = name or f"{NAME_PREFIX}{os.getpid()}"
    _destroy(name)
    r = _run(["lxc-create", "-n", name, "-t", "sshd"], timeout=budget.left())
    if r.returncode:
        raise RuntimeError(f"lxc-create failed: {(r.stderr or r.stdout).strip()[-300:]}")
    try:
        venv = Path(sys.prefix)
        base = Path(sys.base_prefix)
        workdir_host.mkdir(parents=True, exist_ok=True)
        for d, _ in mounts:
            d.mkdir(parents=True, exist_ok=True)
        cfg_path = Path(f"/var/lib/lxc/{name}/config")
        lines = [
            ln
            for ln in cfg_path.read_text().splitlines()
            if not ln.startswith(("lxc.net.", "lxc.apparmor."))
        ]
        if host_network:
            lines += [
                "lxc.net.0.type = none",
                "lxc.init.cmd = /usr/sbin/init.lxc --name " + name + " -- /bin/sleep infinity",
            ]
        else:
            lines.append("lxc.net.0.type = empty")  # loopback only: no network
        lines += [
            *(
                f"lxc.mount.entry = {d} {str(d).lstrip('/')} none rw,bind,create=dir 0 0"
                for d in shared
            ),
            *(
                f"lxc.mount.entry = {d} {inside.lstrip('/')} none rw,bind,create=dir 0 0"
                for d, inside in mounts
            ),
            "lxc.apparmor.profile = unconfined",
            f"lxc.mount.entry = {venv} {str(venv).lstrip('/')} none ro,bind,create=dir 0 0",
            f"lxc.mount.entry = {base} {str(base).lstrip('/')} none ro,bind,create=dir 0 0",
            f"lxc.mount.entry = {workdir_host} {workdir.lstrip('/')} none rw,bind,create=dir 0 0",
            *extra_config,
        ]
        cfg_path.write_text("\n".join(lines) + "\n")
        r = _run(["lxc-start", "-n", name, "-d"], timeout=budget.left())
        if r.returncode:
            raise RuntimeError(f"lxc-start failed: {(r.stderr or r.stdout).strip()[-300:]}")
        budget.until(
            lambda: _run(["lxc-attach", "-n", name, "--", "/bin/true"]).returncode == 0,
            f"container {name} attachable",
            every=0.1,
        )
        # the template's rootfs has no /etc/hosts, so `localhost` does not resolve (a Proxmox
        # container's does: torchrun's c10d picks its free ports on it)
        hosts = "grep -qs localhost /etc/hosts || echo '127.0.0.1 localhost' >> /etc/hosts"
        _run(["lxc-attach", "-n", name, "--", "/bin/sh", "-c", hosts])
        yield Container(name, CTID, workdir_host, str(venv / "bin" / "python"))
    finally:
        _destroy(name)


@dataclass(frozen=True)
class Parts:
    sshd: Sshd
    container: Container


@contextlib.contextmanager
def real_parts(
    base: Path | None = None, *, host_network: bool = False, name: str | None = None
) -> Iterator[Parts]:
    """sshd + container + pct map wiring them together; everything torn down on exit.
    `host_network`: the container shares the host's network namespace (it reaches a server
    on the host's loopback)."""
    own = base is None
    root = Path(tempfile.mkdtemp(prefix="dflt-")) if base is None else base
    try:
        ct_cm = lxc_container(root / "ct-workdir", name=name, host_network=host_network)
        with ct_cm as ct, sshd(root / "sshd") as sd:
            sd.map_file.write_text(f"{ct.ctid} {ct.name}\n")
            write_ct_conf(sd, ct.ctid, default_ct_conf(ct.name))
            yield Parts(sd, ct)
    finally:
        if own:
            shutil.rmtree(root, ignore_errors=True)


def hosts_toml(
    parts: Parts, *, known_hosts: Path, run_config: Path | None = None, name: str = "ct"
) -> str:
    """An inventory pointing at the real parts."""
    lines = [
        "[defaults]",
        f'known_hosts = "{known_hosts}"',
        "use_agent = false",
        "connect_timeout = 5",
        "",
        f"[hosts.{name}]",
        'address = "127.0.0.1"',
        f"port = {parts.sshd.port}",
        'user = "root"',
        f'identity_file = "{parts.sshd.client_key}"',
        f"ctid = {parts.container.ctid}",
        f'workdir = "{CONTAINER_WORKDIR}"',
        f'python = "{parts.container.python}"',
        'session = "dflash-test"',
    ]
    if run_config is not None:
        lines.append(f'run_config = "{run_config}"')
    return "\n".join(lines) + "\n"


def kill_tmux_in(container: Container) -> None:
    _run(["lxc-attach", "-n", container.name, "--", "tmux", "-L", "dflash", "kill-server"])


def halve_lr(text: str) -> tuple[str, str, str]:
    """The config text with [optimizer] lr halved, plus the old and new `lr = ...` lines."""
    m = re.search(r"(?m)^lr = (\S+)", text)
    assert m, "the tiny config has no `lr = ...` line"
    old, new = m.group(0), f"lr = {float(m.group(1)) / 2:g}"
    return text[: m.start()] + new + text[m.end() :], old, new


def bump_buckets(text: str) -> str:
    """The config text with batching.num_buckets + 1 (a resume-breaking change)."""
    m = re.search(r"(?m)^num_buckets = (\d+)", text)
    assert m, "the tiny config has no `num_buckets = ...` line"
    return text[: m.start()] + f"num_buckets = {int(m.group(1)) + 1}" + text[m.end() :]


@contextlib.contextmanager
def hanging_pct(sd: Sshd, seconds: int) -> Iterator[None]:
    """Every `pct` call through this sshd first hangs `seconds` (the shim runs `sleep N`)."""
    hang = Path(f"{sd.map_file}.hang")
    hang.write_text(f"{seconds}\n")
    try:
        yield
    finally:
        hang.unlink(missing_ok=True)


def node_processes(pattern: str) -> list[str]:
    """`pid args` of the processes on this machine (the "node") whose command line matches."""
    r = _run(["pgrep", "-a", "-f", pattern])
    return [ln for ln in r.stdout.splitlines() if ln.strip()]


TINY_ASSETS_BUILD = """
import sys
from trainer.config import TrainConfig
from trainer.pipeline import assets
cfg = TrainConfig.load(sys.argv[1])
assets.ensure_store(cfg)
assets.ensure_target(cfg)
"""


def frozen_tree(dest: Path) -> Path:
    """The committed trainer/ (HEAD), not the working tree: other work in progress in this
    checkout must not race the test, and HEAD is what every commit keeps green."""
    dest.mkdir(parents=True)
    archive = subprocess.run(
        ["git", "-C", str(REPO), "archive", "HEAD", "trainer"],
        capture_output=True,
        timeout=budget.left(),
    )
    if archive.returncode != 0:  # not a git checkout: the files as they are
        shutil.copytree(
            REPO / "trainer", dest / "trainer", ignore=shutil.ignore_patterns("__pycache__")
        )
        return dest
    subprocess.run(
        ["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True, timeout=budget.left()
    )
    return dest


def tree_env(tree: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DFLASH_", "WORLD", "RANK"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PYTHONPATH=str(tree))
    return env


def build_tiny_assets(config: Path, tree: Path) -> None:
    """Build the store and tiny target `config` names (by the trainer in `tree`)."""
    built = subprocess.run(
        [sys.executable, "-c", TINY_ASSETS_BUILD, str(config)],
        env=tree_env(tree),
        capture_output=True,
        text=True,
        timeout=budget.left(),
    )
    if built.returncode != 0:
        raise RuntimeError(f"building the tiny assets failed: {built.stderr[-3000:]}")


GROUP_WORKDIRS = ("/srv/dflash0", "/srv/dflash1")  # distinct: nothing may assume one path
# Two loopback addresses, one per node (both reach this host's lo): torchrun's c10d tells nodes
# apart by (address, pid), and two containers' agents can have the same pid in their own pid
# namespaces, so one address for both made one node of two. As text "127.0.0.10" sorts first:
# c10d ranks node 1 before node 0, the case the trainer's inventory-order ranks are for.
NODE_ADDRESSES = ("127.0.0.2", "127.0.0.10")


@dataclass(frozen=True)
class GroupPair:
    """Two "Proxmox hosts" (loopback sshd + pct shim each) and their containers, in the host's
    network namespace, as the inventory's hosts n0, n1 and group g."""

    inventory: Path
    containers: tuple[Container, Container]
    workdirs: tuple[str, str]
    sshds: tuple[Sshd, Sshd]
    data: tuple[Path, Path] | None = None  # each node's own `private` directory, on this host


@contextlib.contextmanager
def group_pair(
    base: Path,
    *,
    run_config: Path,
    shared: tuple[Path, ...] = (),
    private: str | None = None,
    session: str = "dflash-g",
    group_keys: tuple[str, ...] = (),
    node_addresses: tuple[str, str] = NODE_ADDRESSES,
) -> Iterator[GroupPair]:
    """Two containers sharing the host's network (gloo meets on loopback; `node_addresses`
    are the nodes' own, see NODE_ADDRESSES), each behind its own sshd with its key pinned; `shared` directories are
    mounted at their own path in both (a store every node reads); `private` (say "/data") is a
    directory of each node's own (base/data0, base/data1 here), as two Proxmox nodes have:
    nothing there is shared. `group_keys`: more `[groups.g]` lines (its policy)."""
    stack = contextlib.ExitStack()
    with stack:
        cts = tuple(
            stack.enter_context(
                lxc_container(
                    base / f"ws{i}",
                    name=f"{NAME_PREFIX}{os.getpid()}-n{i}",
                    host_network=True,
                    workdir=GROUP_WORKDIRS[i],
                    shared=shared,
                    mounts=((base / f"data{i}", private),) if private else (),
                )
            )
            for i in range(2)
        )
        sshds = [stack.enter_context(sshd(base / f"sshd{i}")) for i in range(2)]
        known = base / "known_hosts"
        pins = []
        for sd, ct in zip(sshds, cts, strict=True):
            sd.map_file.write_text(f"{ct.ctid} {ct.name}\n")
            write_ct_conf(sd, ct.ctid, default_ct_conf(ct.name))
            pub = sd.host_pub.read_text().split()
            pins.append(f"[127.0.0.1]:{sd.port} {pub[0]} {pub[1]}\n")
        known.write_text("".join(pins))
        text = [
            "[defaults]",
            f'known_hosts = "{known}"',
            "use_agent = false",
            "connect_timeout = 5",
            f'run_config = "{run_config}"',
            f'session = "{session}"',
            'gloo_socket_ifname = "lo"',
            "",
        ]
        for i, (sd, ct) in enumerate(zip(sshds, cts, strict=True)):
            text += [
                f"[hosts.n{i}]",
                'address = "127.0.0.1"',
                f"port = {sd.port}",
                f'identity_file = "{sd.client_key}"',
                f"ctid = {ct.ctid}",
                f'workdir = "{GROUP_WORKDIRS[i]}"',
                f'python = "{ct.python}"',
                f'node_address = "{node_addresses[i]}"',
                'env = { OMP_NUM_THREADS = "1" }',
                "",
            ]
        text += ["[groups.g]", 'hosts = ["n0", "n1"]', f"rdzv_port = {free_port()}"]
        text += [*group_keys, ""]
        inv = base / "hosts.toml"
        inv.write_text("\n".join(text))
        inv.chmod(0o600)
        data = (base / "data0", base / "data1") if private else None
        try:
            yield GroupPair(inv, (cts[0], cts[1]), GROUP_WORKDIRS, (sshds[0], sshds[1]), data)
        finally:
            for ct in cts:
                kill_tmux_in(ct)


@contextlib.contextmanager
def stopped_sshd(sd: Sshd) -> Iterator[None]:
    """The node's sshd stopped (SIGSTOP): new connections hang as on a dead link, the node
    and its container run on; SIGCONT on exit."""
    pid = int((sd.dir / "sshd.pid").read_text().split()[0])
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def node_processes_in(ct: Container, pattern: str) -> list[str]:
    """`pid args` of the processes in the container whose command line matches."""
    r = _run(
        ["lxc-attach", "-n", ct.name, "--", "pgrep", "-a", "-f", pattern], timeout=budget.left()
    )
    return [ln for ln in r.stdout.splitlines() if ln.strip()]


def pinned_inventory(parts: Parts, tmp_path: Path, run_config: Path | None = None) -> list[str]:
    """`--hosts FILE` for the real parts with the sshd key already pinned."""
    known = tmp_path / "known_hosts"
    pub = parts.sshd.host_pub.read_text().split()
    known.write_text(f"[127.0.0.1]:{parts.sshd.port} {pub[0]} {pub[1]}\n")
    inv = tmp_path / "hosts.toml"
    inv.write_text(
        hosts_toml(parts, known_hosts=known, run_config=run_config)
        + 'env = { OMP_NUM_THREADS = "1" }\n'
    )
    return ["--hosts", str(inv)]


def attach(parts: Parts, script: str, *args: str, stdin: str | None = None) -> str:
    res = subprocess.run(
        ["lxc-attach", "-n", parts.container.name, "--", "sh", "-c", script, "sh", *args],
        input=stdin,
        capture_output=True,
        text=True,
        check=False,
    )
    assert res.returncode == 0, res.stderr
    return res.stdout


@contextlib.contextmanager
def container_tmpfs(parts: Parts, path: str, size: str) -> Iterator[str]:
    """A tmpfs of `size` mounted at `path` inside the container (only), unmounted after (a
    directory made for it is removed)."""
    made = attach(parts, '[ -d "$1" ] || { mkdir -p "$1" && echo made; }', path).strip()
    attach(parts, 'mount -t tmpfs -o size="$2" dflt-tmpfs "$1"', path, size)
    try:
        yield path
    finally:
        attach(parts, 'umount "$1"' + (' && rmdir "$1"' if made else ""), path)
