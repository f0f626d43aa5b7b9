"""Restart modal: the config diff, what the restart will do (resume or fresh, naming the keys),
then, once confirmed, the progress and result of push + restart in the same box."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import ClassVar

from rich.syntax import Syntax
from rich.text import Text
from textual import on, work
from textual.app import ComposeResult
from textual.binding import BindingType
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from dflashctl.monitor.restart_plan import RestartPlan

Report = Callable[[str], None]
Execute = Callable[[Report], Awaitable[str]]
"""Runs push + restart, calling `report` with each progress step; returns the result line."""


def verdict_text(plan: RestartPlan) -> Text:
    if plan.error:
        return Text(plan.verdict, style="bold red")
    if plan.fresh:
        return Text("Will " + plan.verdict, style="bold yellow")
    return Text("Will " + plan.verdict, style="bold green")


class RestartScreen(ModalScreen[str | None]):
    """Dismisses with the result line after a restart ran, or None when cancelled."""

    BINDINGS: ClassVar[list[BindingType]] = [
        ("escape", "cancel", "Cancel"),
        ("enter", "confirm", "Confirm / close"),  # whichever widget has focus
    ]
    AUTO_FOCUS = "#confirm"  # enter confirms; escape cancels

    def __init__(self, host: str, plan: RestartPlan, execute: Execute) -> None:
        super().__init__()
        self.host = host
        self.plan = plan
        self.execute = execute
        self.progress: list[str] = []
        self.result: str | None = None
        self.running = False

    def compose(self) -> ComposeResult:
        with Vertical(id="restart-box", classes="modal-box"):
            yield Static(f"Restart {self.host}", classes="modal-title")
            with VerticalScroll(id="restart-diff"):
                if self.plan.diff:
                    yield Static(Syntax(self.plan.diff, "diff", theme="ansi_dark"), id="diff")
                else:
                    yield Static(
                        "No config change: the deployed config is the local one.", id="diff"
                    )
            yield Static(verdict_text(self.plan), id="verdict")
            yield Static("", id="restart-progress")
            with Horizontal(classes="modal-buttons"):
                yield Button(
                    "Push + restart",
                    variant="warning" if self.plan.fresh else "success",
                    id="confirm",
                    disabled=self.plan.error is not None,
                )
                yield Button("Cancel", id="cancel")
                yield Button("Close", id="close", variant="primary")

    def _report(self, line: str) -> None:
        self.progress.append(line)
        self.query_one("#restart-progress", Static).update("\n".join(self.progress))

    @on(Button.Pressed, "#confirm")
    def action_confirm(self) -> None:
        """Enter or the button: run the restart; once it finished, close with its result."""
        if self.running or self.plan.error is not None:
            return
        if self.result is not None:
            self.dismiss(self.result)
            return
        self.running = True
        self.query_one("#confirm", Button).disabled = True
        self.query_one("#cancel", Button).disabled = True
        self._run()

    @work(exclusive=True, exit_on_error=False, group="restart")
    async def _run(self) -> None:
        try:
            result = await self.execute(self._report)
        except Exception as exc:  # the service's one-line error is the result shown
            result = f"failed: {exc}"
            self._report(result)
        else:
            self._report(result)
        self.result = result
        self.running = False
        # A fresh button (not the confirm one relabelled): Button ignores a press within 0.2 s
        # of the previous one, which would swallow an Enter after a fast restart.
        self.query_one("#confirm", Button).display = False
        self.query_one("#cancel", Button).display = False
        close = self.query_one("#close", Button)
        close.display = True
        close.focus()

    @on(Button.Pressed, "#close")
    def _close(self) -> None:
        self.dismiss(self.result)

    @on(Button.Pressed, "#cancel")
    def action_cancel(self) -> None:
        if not self.running:
            self.dismiss(self.result)
