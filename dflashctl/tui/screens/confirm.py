"""A yes/no modal for destructive actions (stop)."""

from __future__ import annotations

from typing import ClassVar

from textual import on
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "dismiss(False)", "Cancel"),
        ("y", "dismiss(True)", "Yes"),
    ]

    def __init__(self, question: str, confirm_label: str = "Yes") -> None:
        super().__init__()
        self.question = question
        self.confirm_label = confirm_label

    def compose(self) -> ComposeResult:
        with Vertical(classes="modal-box"):
            yield Static(self.question, classes="modal-title")
            with Horizontal(classes="modal-buttons"):
                yield Button(self.confirm_label, variant="error", id="yes")
                yield Button("Cancel", id="no")

    @on(Button.Pressed, "#yes")
    def _yes(self) -> None:
        self.dismiss(True)

    @on(Button.Pressed, "#no")
    def _no(self) -> None:
        self.dismiss(False)
