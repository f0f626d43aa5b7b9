"""Atomic, content-addressed deploys of the trainer package into a container.

Order of operations (each a single remote round trip):
  container running? -> take WORKDIR/.deploy.lock (mkdir: atomic) + preflight probe
  -> [only if releases/<id>/.complete is missing] tar on stdin into releases/.tmp-<id>-<pid>,
     verify the unpacked tree hash, write .complete, rename to releases/<id>
  -> write run/config.toml, switch `current` (symlink to a temp name + mv -T: never a moment
     without a link), prune old releases (never `current` nor the one the running trainer
     uses), unlock.
A failure anywhere before the switch leaves `current` untouched.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dflashctl.inventory import HostConfig
from dflashctl.preflight import (
    GIB,
    PROBE_SCRIPT,
    Preflight,
    judge_probe,
    parse_probe_output,
)
from dflashctl.release import VERIFY_SCRIPT, Release, build_release
from dflashctl.remote.commands import write_file_atomic
from dflashctl.remote.transport import Transport, TransportError

Progress = Callable[[str], None]
LOCK_NAME = ".deploy.lock"
RUNNING_RELEASE_FILE = "run/.release"


class DeployError(Exception):
    """A deploy failed; str() is one line per problem, each naming the host."""


class LockHeld(DeployError):
    """Another deploy holds the lock (it is theirs: we must not remove it)."""


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


def locked_argv(workdir: str, owner: str, argv: list[str]) -> list[str]:
    """Take WORKDIR/.deploy.lock (mkdir is atomic), then exec argv: one round trip.

    Exit 75 with "held by: OWNER" when another deploy holds it; any other exit status means we
    hold it (even if argv itself failed) and must release it.
    """
    script = (
        'mkdir -p "$1" || exit 74; '
        'if ! mkdir "$1/' + LOCK_NAME + '" 2>/dev/null; then '
        'echo "held by: $(cat "$1/' + LOCK_NAME + '/owner" 2>/dev/null)"; exit 75; fi; '
        'printf "%s\\n" "$2" > "$1/' + LOCK_NAME + '/owner"; shift 2; exec "$@"'
    )
    return ["sh", "-c", script, "dflash-lock", workdir, owner, *argv]


def unlock_argv(workdir: str, owner: str) -> list[str]:
    """Remove the deploy lock only if it is ours (its owner line matches)."""
    script = (
        'l="$1/' + LOCK_NAME + '"; '
        'if [ "$(cat "$l/owner" 2>/dev/null)" = "$2" ]; then rm -rf "$l"; fi'
    )
    return ["sh", "-c", script, "dflash-unlock", workdir, owner]


def probe_argv(python: str, workdir: str, release: str, *, import_check: bool = True) -> list[str]:
    mode = "import" if import_check else "metadata"
    return [python, "-c", PROBE_SCRIPT, workdir, release, mode]


# $1 workdir, $2 release id, $3 python, $4 verify script. Tar archive on stdin.
UNPACK_SCRIPT = r"""set -e
cd "$1"
mkdir -p releases
rm -rf releases/.tmp-*
tmp="releases/.tmp-$2-$$"
mkdir "$tmp"
tar -x -f - -C "$tmp" --no-same-owner
got=$("$3" -c "$4" "$tmp" trainer)
if [ "$got" != "$2" ]; then
  rm -rf "$tmp"
  echo "unpacked tree hashes to $got, expected $2 (transfer corrupted?)" >&2
  exit 3
fi
touch "$tmp/.complete"
rm -rf "releases/$2"
mv -T "$tmp" "releases/$2"
"""


def unpack_argv(workdir: str, release: str, python: str) -> list[str]:
    return ["sh", "-c", UNPACK_SCRIPT, "dflash-unpack", workdir, release, python, VERIFY_SCRIPT]


# $1 workdir, $2 release id, $3 releases to keep, $4 "config" when the run config comes on stdin.
# Writes the config (temp + rename), switches `current`, prunes, and releases the deploy lock
# last; `set -e` leaves the lock for the caller's cleanup if anything fails.
SWITCH_SCRIPT = r"""set -e
cd "$1"
test -f "releases/$2/.complete"
if [ "$4" = config ]; then
  mkdir -p run
  cat > "run/.config.toml.tmp.$$"
  mv -f "run/.config.toml.tmp.$$" run/config.toml
fi
ln -s "releases/$2" ".current.tmp.$$"
mv -T ".current.tmp.$$" current
keep="$2 $(cat run/.release 2>/dev/null || true)"
n=0
for m in $(ls -1t releases/*/.complete 2>/dev/null); do
  d=${m%/.complete}; h=${d#releases/}
  case " $keep " in *" $h "*) continue;; esac
  n=$((n+1))
  if [ "$n" -ge "$3" ]; then rm -rf "$d"; echo "pruned $h"; fi
done
rm -rf .deploy.lock
"""


def switch_argv(workdir: str, release: str, keep: int, *, with_config: bool = False) -> list[str]:
    flag = "config" if with_config else "-"
    return ["sh", "-c", SWITCH_SCRIPT, "dflash-switch", workdir, release, str(keep), flag]


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
    if owner is not None and res.rc == 75:
        raise LockHeld(
            f"{host.name}: another deploy holds {host.workdir}/{LOCK_NAME} "
            f"({res.stdout.strip()}); remove it only if no deploy is running"
        )
    if res.rc == 74:
        raise DeployError(f"{host.name}: cannot create {host.workdir}: {res.error_line()}")
    if res.rc in (126, 127) or ("No such file" in res.stderr and res.rc != 0):
        raise DeployError(
            f"{host.name}: {host.python} not found in container {host.ctid} "
            f"(set `python` in hosts.toml): {res.error_line()}"
        )
    probe = parse_probe_output(res.stdout)
    if probe is None:
        raise DeployError(f"{host.name}: preflight probe failed: {res.error_line()}")
    return judge_probe(host.name, host.python, host.workdir, probe, min_free_bytes=min_free_bytes)


async def push_config_file(transport: Transport, host: HostConfig, path: Path) -> None:
    """Validate locally, then write WORKDIR/run/config.toml atomically."""
    from dflashctl.runconfig import validate_config

    validate_config(path)
    res = await transport.run(
        write_file_atomic(f"{host.run_dir}/config.toml", "644"), input=path.read_bytes(), timeout=60
    )
    if not res.ok:
        raise DeployError(f"{host.name}: writing {host.run_dir}/config.toml: {res.error_line()}")


async def deploy(
    transport: Transport,
    host: HostConfig,
    *,
    progress: Progress | None = None,
    config: Path | None = None,
    release: Release | None = None,
    min_free_bytes: int = GIB,
    import_check: bool = True,
) -> DeployResult:
    """Deploy the trainer tree (default: the installed `trainer` package) to `host`.

    `import_check=False` reads module versions from metadata instead of importing them (fast;
    for tests and benchmarks that deploy repeatedly). The CLI always imports.
    """
    if config is not None:  # a bad config fails here, before anything touches the host
        from dflashctl.runconfig import validate_config

        validate_config(config)
    rel = release or build_release()
    _emit(progress, f"{host.name}: release {rel.id} ({rel.files} files, {len(rel.tar)} bytes)")
    await check_container(transport, host)
    owner = f"{socket.gethostname()} pid {os.getpid()} at {time.strftime('%Y-%m-%dT%H:%M:%S')}"
    holding = False
    try:
        min_free = max(min_free_bytes, 4 * len(rel.tar))
        holding = True  # from here on the lock may be ours; unlock checks its owner line
        try:
            pre = await run_preflight(
                transport,
                host,
                rel.id,
                min_free_bytes=min_free,
                import_check=import_check,
                owner=owner,
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
                unpack_argv(host.workdir, rel.id, host.python), input=rel.tar, timeout=600
            )
            if not res.ok:
                raise DeployError(f"{host.name}: unpacking release {rel.id}: {res.error_line()}")
            sent = len(rel.tar)
        res = await transport.run(
            switch_argv(host.workdir, rel.id, host.keep_releases, with_config=config is not None),
            input=config.read_bytes() if config is not None else None,
            timeout=60,
        )
        if not res.ok:
            raise DeployError(f"{host.name}: switching current to {rel.id}: {res.error_line()}")
        holding = False  # the switch script released it
        if config is not None:
            _emit(progress, f"{host.name}: pushed {config} -> {host.run_dir}/config.toml")
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
                await transport.run(unlock_argv(host.workdir, owner), timeout=30)
