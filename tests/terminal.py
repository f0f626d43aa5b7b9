"""A real terminal for tests: a private tmux server holding one window; capture-pane reads it."""

from __future__ import annotations

import shlex
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

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

    def wait(self, what: str, predicate: Callable[[str], bool], timeout: float) -> str:
        deadline = time.monotonic() + timeout
        text = ""
        while time.monotonic() < deadline:
            text = self.screen()
            if predicate(text):
                return text
            time.sleep(0.5)
        raise AssertionError(f"timed out waiting for {what}; screen:\n{text}")

    def kill(self) -> None:
        self.tmux("kill-server")
