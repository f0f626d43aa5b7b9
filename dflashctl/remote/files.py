"""Pure argv builders for files in the container: read one, read from a line, count lines,
follow by name, write atomically through stdin. Paths come from dflashctl.remote.layout.
"""

from __future__ import annotations


def tail_from(path: str, from_line: int = 0) -> list[str]:
    """`path` from 0-based line `from_line` to its end (one read)."""
    return ["tail", "-n", f"+{int(from_line) + 1}", path]


def line_count(path: str) -> list[str]:
    """`wc -l PATH`: prints `N PATH`."""
    return ["wc", "-l", path]


def tail_follow(path: str, from_line: int = 0) -> list[str]:
    """Stream `path` from 0-based line `from_line` on, following it by name across rotation."""
    return ["tail", "-n", f"+{int(from_line) + 1}", "-F", path]


def write_file_atomic(path: str, mode: str = "644") -> list[str]:
    """Write stdin to `path` via a temp file + rename: readers never see a half-written file."""
    script = (
        'set -e; umask 077; mkdir -p "$(dirname "$1")"; tmp="$1.tmp.$$"; '
        'cat > "$tmp"; chmod "$2" "$tmp"; mv -f "$tmp" "$1"'
    )
    return ["sh", "-c", script, "dflash-write", path, mode]


def read_file(path: str) -> list[str]:
    return ["cat", "--", path]
