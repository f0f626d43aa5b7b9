"""Help screen: the key map (the same table docs/tui.md shows)."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Static

QUIT_KEEPS_RUNS = "quit (the runs keep going)"

KEYMAP: tuple[tuple[str, str], ...] = (
    ("enter", "open the highlighted host (or group: its nodes and their GPUs)"),
    ("space", "fleet: open or close a group's node rows"),
    ("escape", "back to the fleet (closes modals)"),
    ("r", "restart: show the config diff and resume/fresh verdict, confirm to push + restart"),
    ("d", "deploy the trainer release to the host"),
    ("s", "stop the run gracefully (asks first)"),
    ("e", "edit the host's local run config in $EDITOR (app suspended)"),
    ("a", "attach to the run's tmux session (app suspended; detach with C-b d)"),
    ("l", "full log screen"),
    ("c", "reconnect now (skip the backoff wait)"),
    ("ctrl+p", "command palette: every action above by name"),
    ("?", "this help"),
    ("q", QUIT_KEEPS_RUNS),
)


def keymap_table(quit_action: str = QUIT_KEEPS_RUNS) -> Table:
    """The key map; `quit_action` says what `q` does in this app (the demo stops its run)."""
    table = Table(show_header=True, header_style="bold", box=None, padding=(0, 2))
    table.add_column("key", style="bold cyan")
    table.add_column("action")
    for key, action in KEYMAP:
        table.add_row(key, quit_action if key == "q" else action)
    return table


class HelpScreen(ModalScreen[None]):
    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "dismiss", "Close"),
        ("question_mark", "dismiss", "Close"),
    ]

    def __init__(self, quit_action: str = QUIT_KEEPS_RUNS) -> None:
        super().__init__()
        self.quit_action = quit_action

    def compose(self) -> ComposeResult:
        with Vertical(id="help-box", classes="modal-box"):
            yield Static("dflashctl keys", classes="modal-title")
            yield Static(keymap_table(self.quit_action))
