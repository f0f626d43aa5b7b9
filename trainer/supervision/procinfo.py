"""What /proc tells about a process without privileges: state, threads, wait channels, cgroup OOMs.

A SIGSTOPped process runs no signal handler, so it cannot dump its own stacks; this snapshot is
what can still be recorded about it. /proc/PID/stack (kernel stacks) needs CAP_SYS_ADMIN and is
reported as unreadable when it is.
"""

from __future__ import annotations

import os
from pathlib import Path


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return None


def status_fields(pid: int) -> dict[str, str]:
    text = _read(Path(f"/proc/{pid}/status")) or ""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def is_stopped(pid: int) -> bool:
    """True when the process is stopped (SIGSTOP, `T`) or traced-stopped (`t`)."""
    return status_fields(pid).get("State", "")[:1] in ("T", "t")


def catches(pid: int, signum: int) -> bool:
    """True when the process has a handler for `signum` (SigCgt): e.g. faulthandler's SIGUSR1."""
    mask = status_fields(pid).get("SigCgt")
    try:
        return bool(int(mask, 16) >> (signum - 1) & 1) if mask else False
    except ValueError:
        return False


def snapshot(pid: int) -> list[str]:
    """Lines describing the process and each of its threads (state, wait channel, syscall)."""
    fields = status_fields(pid)
    if not fields:
        return [f"/proc/{pid}: gone"]
    keys = ("Name", "State", "Threads", "VmRSS", "voluntary_ctxt_switches")
    lines = [f"/proc/{pid}/status: " + "; ".join(f"{k} {fields[k]}" for k in keys if k in fields)]
    task_dir = Path(f"/proc/{pid}/task")
    try:
        tids = sorted(int(t) for t in os.listdir(task_dir))
    except OSError:
        tids = []
    for tid in tids:
        base = task_dir / str(tid)
        comm = (_read(base / "comm") or "?").strip()
        stat = _read(base / "stat") or ""
        state = stat.rpartition(")")[2].split()[:1]
        wchan = (_read(base / "wchan") or "?").strip() or "0"
        syscall = (_read(base / "syscall") or "unreadable").split()[:1]
        lines.append(
            f"  thread {tid} {comm!r}: state {state[0] if state else '?'}, wchan {wchan}, "
            f"syscall {syscall[0] if syscall else '?'}"
        )
    stack = _read(Path(f"/proc/{pid}/stack"))
    if stack is None:
        lines.append(f"/proc/{pid}/stack: unreadable without CAP_SYS_ADMIN")
    else:
        lines += [f"/proc/{pid}/stack: {x}" for x in stack.splitlines()]
    return lines


def _oom_counter_files() -> list[Path]:
    """Where this process's cgroup counts OOM kills: v2 memory.events, v1 memory.oom_control."""
    text = _read(Path("/proc/self/cgroup")) or ""
    files: list[Path] = []
    for line in text.splitlines():
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        rel = path.lstrip("/")
        if controllers == "" and path:  # v2 unified hierarchy ("0::/path")
            files.append(Path("/sys/fs/cgroup") / rel / "memory.events")
        elif "memory" in controllers.split(","):
            files.append(Path("/sys/fs/cgroup/memory") / rel / "memory.oom_control")
            files.append(Path("/sys/fs/cgroup/memory/memory.oom_control"))  # a namespaced root
    return files


def oom_kills() -> int | None:
    """The kernel OOM killer's count for this process's cgroup, None when no file tells it."""
    for path in _oom_counter_files():
        for line in (_read(path) or "").splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of the process (all threads), from /proc/PID/stat."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    if not stat:
        return None
    rest = stat.rpartition(")")[2].split()
    return (int(rest[11]) + int(rest[12])) / os.sysconf("SC_CLK_TCK")


def rss_kib(pid: int) -> tuple[int, int] | None:
    """(VmRSS, VmHWM) in KiB."""
    f = status_fields(pid)
    try:
        return int(f["VmRSS"].split()[0]), int(f["VmHWM"].split()[0])
    except (KeyError, ValueError, IndexError):
        return None


def children(pid: int) -> list[int]:
    """The live child processes of `pid` (a group node's torchrun: its workers), from /proc."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for name in entries:
        if not name.isdigit():
            continue
        stat = _read(Path(f"/proc/{name}/stat")) or ""
        rest = stat.rpartition(")")[2].split()
        if len(rest) > 1 and rest[1] == str(pid) and rest[0] != "Z":
            found.append(int(name))
    return sorted(found)


def gone(pid: int) -> bool:
    """The process exited (no entry, or a zombie its parent has not reaped yet)."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    return stat is None or stat.rpartition(")")[2].split()[:1] == ["Z"]
