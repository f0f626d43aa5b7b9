"""A real terminal for tests: a private tmux server holding one window; capture-pane reads it."""

from __future__ import annotations

import shlex
import subprocess
from collections.abc import Callable
from pathlib import Path

from tests import budget

ROOT = Path(__file__).resolve().parents[1]


class Terminal:
    """A tmux server on a private socket holding one window of the given size."""

    def __init__(self, socket: str, width: int = 140, height: int = 45) -> None:
        self.socket = socket
        self.size = (width, height)

    def tmux(self, *args: str) -> str:
        out = subprocess.run(
            ["tmux", "-L", self.socket, *args], capture_output=True, text=True, check=False
        )
        return out.stdout

    def start(self, argv: list[str], env: dict[str, str]) -> None:
        """Run argv in the window; its exit status is then printed as `exit=N` and kept on screen."""
        exports = " ".join(f"{k}={shlex.quote(v)}" for k, v in env.items())
        cmd = f'cd {ROOT} && env {exports} {shlex.join(argv)}; echo "exit=$?"; sleep 30'
        w, h = self.size
        subprocess.run(
            [
                "tmux",
                "-L",
                self.socket,
                "new-session",
                "-d",
                "-s",
                "tui",
                "-x",
                str(w),
                "-y",
                str(h),
                cmd,
            ],
            check=True,
        )

    def screen(self) -> str:
        return self.tmux("capture-pane", "-p", "-t", "=tui:")

    def keys(self, *keys: str) -> None:
        self.tmux("send-keys", "-t", "=tui:", *keys)

    def wait(self, what: str, predicate: Callable[[str], bool]) -> str:
        """The screen once `predicate` holds for it, within the test's one budget."""
        seen = [""]

        def shows() -> str | None:
            seen[0] = self.screen()
            return seen[0] if predicate(seen[0]) else None

        return budget.until(shows, what, every=0.5, detail=lambda: f"screen:\n{seen[0]}")

    def kill(self) -> None:
        self.tmux("kill-server")
