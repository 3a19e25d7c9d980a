"""Every verb that changes the server goes through this dialog, which says what it frees or holds."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

from tui.impact import Impact


class ConfirmScreen(ModalScreen[bool]):
    """Dismisses with True only on the confirm button or ``y``; ``n``/escape cancel."""

    BINDINGS = [
        Binding("y", "answer(True)", "Confirm"),
        Binding("n,escape", "answer(False)", "Cancel"),
    ]

    def __init__(self, impact: Impact) -> None:
        super().__init__()
        self.impact = impact

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog", classes="dialog"):
            yield Static(self.impact.title, classes="dialog-title")
            yield Static(self.impact.body, id="impact", classes="dialog-body")
            with Horizontal(classes="dialog-buttons"):
                if self.impact.possible:
                    yield Button(f"{self.impact.confirm} (y)", id="confirm", variant="warning")
                yield Button("Cancel (n)" if self.impact.possible else "Close (esc)", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()  # enter on an untouched dialog never changes the server

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes and self.impact.possible)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "confirm")
