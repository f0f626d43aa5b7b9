"""Atomic, content-addressed deploys of the trainer package into a container.

Order of operations (each a single remote round trip):
  container running? -> take WORKDIR/.deploy.lock (mkdir: atomic) + preflight probe
  -> [only if releases/<id>/.complete is missing] tar on stdin into releases/.tmp-<id>-<pid>,
     verify the unpacked tree hash, write .complete, rename to releases/<id>
  -> write run/config.toml, switch `current` (symlink to a temp name + mv -T: never a moment
     without a link), prune old releases (never `current` nor the one the running trainer
     uses), unlock -> acknowledge the switch.
A failure anywhere before the switch leaves `current` untouched.

The switch leaves WORKDIR/.deploy-switched (owner, previous, new) until the client that made it
has read the result and removes it: a client killed while the switch ran cannot leave `current`
changed without anyone saying so (status, start and the next deploy report it). A lock whose
owner provably died (same machine, pid gone or reused) is taken over with a message; any other
lock is broken only by `deploy --break-lock`, never while its deploy is provably alive.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflashctl.config.inventory import HostConfig
from dflashctl.errors import DflashctlError, ExitCode
from dflashctl.releases.preflight import (
    GIB,
    Preflight,
    judge_memory,
    judge_probe,
    parse_probe_output,
    smallest_gpu,
)
from dflashctl.releases.release import VERIFY_SCRIPT, Release, build_release
from dflashctl.remote.files import write_file_atomic
from dflashctl.remote.layout import RemoteLayout
from dflashctl.remote.probe import memory_argv, probe_argv
from dflashctl.remote.release import (
    LOCK_BUSY_RC,
    LOCK_HELD_RC,
    NO_WORKDIR_RC,
    acknowledge_switch,
    break_lock_argv,
    locked_argv,
    read_lock_owner_argv,
    switch_argv,
    take_over_argv,
    unlock_argv,
    unpack_argv,
)
from dflashctl.remote.transport import Transport, TransportError

Progress = Callable[[str], None]
OWNER_RE = re.compile(r"(?P<host>\S+) pid (?P<pid>\d+)(?: start (?P<start>\d+))? at (?P<at>\S+)")


class DeployError(DflashctlError):
    """A deploy failed; str() is one line per problem, each naming the host."""

    exit_code = ExitCode.FAILED


class LockHeld(DeployError):
    """Another deploy holds the lock (it is theirs: we must not remove it)."""

    def __init__(self, message: str, owner: str = "") -> None:
        super().__init__(message)
        self.owner = owner


# --- the lock's owner ----------------------------------------------------------------------


def _proc_start(pid: int) -> str | None:
    """Start time of `pid` in clock ticks since boot (/proc/PID/stat field 22), if readable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rfind(")") + 2 :].split()
    return fields[19] if len(fields) > 19 else None


def lock_owner(pid: int | None = None) -> str:
    """`HOST pid N start T at TIME`: enough to tell later whether that process still runs."""
    pid = os.getpid() if pid is None else pid
    start = _proc_start(pid)
    tag = f" start {start}" if start else ""
    return f"{socket.gethostname()} pid {pid}{tag} at {time.strftime('%Y-%m-%dT%H:%M:%S')}"


def owner_alive(owner: str) -> bool | None:
    """Is the deploy that wrote `owner` still running? None: cannot tell (another machine).

    Dead means: same machine and the pid is gone, or it now belongs to another process (its
    start time differs, or, for owners without one, it is not a dflashctl process).
    """
    m = OWNER_RE.fullmatch(owner.strip())
    if m is None or m["host"] != socket.gethostname():
        return None
    pid = int(m["pid"])
    if not Path("/proc/self/stat").exists():  # no /proc (macOS): only "is the pid there"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    start = _proc_start(pid)
    if start is None:
        return False
    if m["start"]:
        return start == m["start"]
    if pid == os.getpid():
        return True
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"dflashctl" in cmdline


# --- the switch marker ---------------------------------------------------------------------


def switch_note(marker: str, current: str) -> str | None:
    """A line for people from WORKDIR/.deploy-switched (None when there is none)."""
    parts = marker.strip().split("\t")
    if len(parts) < 3:
        return None
    owner, previous, new = parts[0], parts[1] or "None", parts[2]
    now = current.rsplit("/", 1)[-1] if current else "None"
    done = "it is switched" if now == new else f"current is {now}"
    return (
        f"a deploy switched current {previous.rsplit('/', 1)[-1]} -> {new} and never reported "
        f"back ({owner}); {done}"
    )


@dataclass(frozen=True)
class DeployResult:
    host: str
    release: str
    transferred_bytes: int
    files: int
    switched: bool
    previous: str | None
    preflight: Preflight
    pruned: list[str] = field(default_factory=list)
    config_pushed: bool = False

    def summary(self) -> str:
        sent = (
            f"sent {self.transferred_bytes / 1024:.1f} KiB ({self.files} files)"
            if self.transferred_bytes
            else "already present, nothing sent"
        )
        switch = (
            f"current {self.previous} -> {self.release}" if self.switched else "current unchanged"
        )
        return f"{self.host}: release {self.release}: {sent}; {switch}"


def _emit(progress: Progress | None, msg: str) -> None:
    if progress is not None:
        progress(msg)


async def check_container(transport: Transport, host: HostConfig) -> None:
    state = await transport.container_state()
    if state != "running":
        raise DeployError(
            f"{host.name}: container {host.ctid} is {state}, not running (pct start {host.ctid})"
        )


async def run_preflight(
    transport: Transport,
    host: HostConfig,
    release: str,
    *,
    min_free_bytes: int,
    import_check: bool = True,
    owner: str | None = None,
) -> Preflight:
    """Run the probe (taking the deploy lock first when `owner` is given) and judge it."""
    argv = probe_argv(host.python, host.workdir, release, import_check=import_check)
    if owner is not None:
        argv = locked_argv(host.workdir, owner, argv)
    res = await transport.run(argv, timeout=180)
    if owner is not None and res.rc == LOCK_HELD_RC:
        held = res.stdout.strip().removeprefix("held by:").strip()
        raise LockHeld(
            f"{host.name}: another deploy holds {RemoteLayout(host.workdir).deploy_lock} "
            f"(held by: {held or 'unknown owner'}); if no deploy is running there: "
            f"dflashctl deploy {host.name} --break-lock",
            held,
        )
    if res.rc == NO_WORKDIR_RC:
        raise DeployError(f"{host.name}: cannot create {host.workdir}: {res.error_line()}")
    if res.rc in (126, 127) or ("No such file" in res.stderr and res.rc != 0):
        raise DeployError(
            f"{host.name}: {host.python} not found in container {host.ctid} "
            f"(dflashctl setup {host.name} builds one, or set `python` in hosts.toml): "
            f"{res.error_line()}"
        )
    probe = parse_probe_output(res.stdout)
    if probe is None:
        raise DeployError(f"{host.name}: preflight probe failed: {res.error_line()}")
    return judge_probe(host.name, host.python, host.workdir, probe, min_free_bytes=min_free_bytes)


async def memory_preflight(
    transport: Transport,
    host: HostConfig,
    release: str,
    config: Path,
    pre: Preflight,
    progress: Progress | None = None,
) -> None:
    """The release's memory estimate in the container: fit on its smallest GPU, checkpoints on
    its disk. Emits the notes; raises DeployError with one line per refusal."""
    gpu = smallest_gpu(pre.gpus)
    res = await transport.run(
        memory_argv(host.python, host.workdir, release, gpu[1] if gpu else None),
        input=config.read_bytes(),
        timeout=300,
    )
    probe = parse_probe_output(res.stdout)
    if probe is None:
        raise DeployError(f"{host.name}: memory check failed: {res.error_line()}")
    verdict = judge_memory(host.name, str(config), host.run_dir, pre.gpus, probe)
    for note in verdict.notes:
        _emit(progress, note)
    if verdict.failures:
        raise DeployError("\n".join(verdict.failures))


async def push_config_file(transport: Transport, host: HostConfig, path: Path) -> None:
    """Validate locally, then write WORKDIR/run/config.toml atomically."""
    from dflashctl.config.runconfig import validate_config

    validate_config(path)
    res = await transport.run(
        write_file_atomic(RemoteLayout(host.workdir).config, "644"), input=path.read_bytes()
    )
    if not res.ok:
        raise DeployError(
            f"{host.name}: writing {RemoteLayout(host.workdir).config}: {res.error_line()}"
        )


async def _take_lock_and_probe(
    transport: Transport,
    host: HostConfig,
    rel: Release,
    owner: str,
    *,
    min_free: int,
    import_check: bool,
    progress: Progress | None,
) -> Preflight:
    """The locked preflight; a lock whose owner provably died is taken over (once)."""
    for attempt in range(2):
        try:
            return await run_preflight(
                transport,
                host,
                rel.id,
                min_free_bytes=min_free,
                import_check=import_check,
                owner=owner,
            )
        except LockHeld as held:
            if attempt or not held.owner or owner_alive(held.owner) is not False:
                raise
            _emit(
                progress,
                f"{host.name}: taking over a stale deploy lock: its owner ({held.owner}) is no "
                f"longer running",
            )
            await transport.run(take_over_argv(host.workdir, held.owner))
    raise AssertionError("unreachable")


async def break_lock(transport: Transport, host: HostConfig, progress: Progress | None) -> None:
    """`deploy --break-lock`: remove the lock unless its deploy is provably alive."""
    res = await transport.run(read_lock_owner_argv(host.workdir))
    owner = res.stdout.strip()
    if owner and owner_alive(owner):
        raise DeployError(
            f"{host.name}: not breaking {RemoteLayout(host.workdir).deploy_lock}: its deploy is still running "
            f"({owner})"
        )
    res = await transport.run(break_lock_argv(host.workdir))
    if res.rc == LOCK_BUSY_RC:
        raise DeployError(
            f"{host.name}: not breaking {RemoteLayout(host.workdir).deploy_lock}: a deploy step is running in "
            f"container {host.ctid} ({res.stdout.strip().removeprefix('busy: ')})"
        )
    if not res.ok:
        raise DeployError(f"{host.name}: breaking the deploy lock: {res.error_line()}")
    out = res.stdout.strip()
    if out.startswith("broke:"):
        who = out.removeprefix("broke:").strip() or "unknown owner"
        _emit(progress, f"{host.name}: broke the deploy lock held by: {who}")


async def deploy(
    transport: Transport,
    host: HostConfig,
    *,
    progress: Progress | None = None,
    config: Path | None = None,
    release: Release | None = None,
    min_free_bytes: int = GIB,
    import_check: bool = True,
    fresh: bool = False,
    resume_checked: bool = False,
    break_stale_lock: bool = False,
    memory_check: bool = False,
) -> DeployResult:
    """Deploy the trainer tree (default: the installed `trainer` package) to `host`.

    A pushed config goes through the resume check (dflashctl.releases.resume) unless the caller already
    made it (`resume_checked`, restart) or the run is meant to start over (`fresh`).
    `import_check=False` reads module versions from metadata instead of importing them (fast;
    for tests and benchmarks that deploy repeatedly). The CLI always imports.
    `memory_check` runs the release's memory estimate on the pushed config before the switch
    (`memory_preflight`); the CLI does unless `--no-memory-check`.
    """
    if config is not None:  # a bad config fails here, before anything touches the host
        from dflashctl.config.runconfig import validate_config

        validate_config(config)
    rel = release or build_release()
    _emit(progress, f"{host.name}: release {rel.id} ({rel.files} files, {len(rel.tar)} bytes)")
    await check_container(transport, host)
    if config is not None and not resume_checked:
        from dflashctl.releases.resume import check_config_push

        check = await check_config_push(
            transport,
            host,
            config,
            fresh=fresh,
            fresh_hint=f"`dflashctl deploy {host.name} --fresh` then `start --fresh`",
        )
        for note in check.notes:
            _emit(progress, note)
    if break_stale_lock:
        await break_lock(transport, host, progress)
    owner = lock_owner()
    holding = False
    try:
        min_free = max(min_free_bytes, 4 * len(rel.tar))
        holding = True  # from here on the lock may be ours; unlock checks its owner line
        try:
            pre = await _take_lock_and_probe(
                transport,
                host,
                rel,
                owner,
                min_free=min_free,
                import_check=import_check,
                progress=progress,
            )
        except LockHeld:
            holding = False
            raise
        for note in pre.notes:
            _emit(progress, note)
        if not pre.ok:
            raise DeployError("\n".join(pre.failures))
        _emit(progress, f"{host.name}: preflight ok: {pre.summary()}")
        sent = 0
        if not pre.release_complete:
            _emit(progress, f"{host.name}: sending {len(rel.tar)} bytes")
            res = await transport.run(
                unpack_argv(host.workdir, rel.id, host.python, VERIFY_SCRIPT),
                input=rel.tar,
                timeout=600,
            )
            if not res.ok:
                raise DeployError(f"{host.name}: unpacking release {rel.id}: {res.error_line()}")
            sent = len(rel.tar)
        if memory_check and config is not None:
            await memory_preflight(transport, host, rel.id, config, pre, progress)
        res = await transport.run(
            switch_argv(
                host.workdir,
                rel.id,
                host.keep_releases,
                with_config=config is not None,
                owner=owner,
            ),
            input=config.read_bytes() if config is not None else None,
        )
        if not res.ok:
            raise DeployError(f"{host.name}: switching current to {rel.id}: {res.error_line()}")
        holding = False  # the switch script released it
        for line in res.stdout.splitlines():
            if line.startswith("unreported: "):
                unreported = switch_note(line.removeprefix("unreported: "), pre.current or "")
                _emit(progress, f"{host.name}: note: {unreported}")
        # We have the result: the switch is reported (to our caller) from here on.
        with contextlib.suppress(TransportError):
            await transport.run(acknowledge_switch(host.workdir, owner))
        if config is not None:
            _emit(progress, f"{host.name}: pushed {config} -> {RemoteLayout(host.workdir).config}")
        pruned = [ln.split()[1] for ln in res.stdout.splitlines() if ln.startswith("pruned ")]
        return DeployResult(
            host=host.name,
            release=rel.id,
            transferred_bytes=sent,
            files=rel.files,
            switched=pre.current != rel.id,
            previous=pre.current,
            preflight=pre,
            pruned=pruned,
            config_pushed=config is not None,
        )
    finally:
        # Best effort: a lost link must not mask the real error; the lock names its owner.
        if holding:
            with contextlib.suppress(TransportError):
                await transport.run(unlock_argv(host.workdir, owner))
