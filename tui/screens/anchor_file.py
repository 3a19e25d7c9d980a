"""Ask for the file holding a new anchor's system prompt (text, or JSON with ``system`` and ``tools``)."""

from __future__ import annotations

from pathlib import Path

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.screen import ModalScreen
from textual.widgets import Input, Static


class AnchorFileScreen(ModalScreen[Path | None]):
    """Dismisses with a readable file's path, or None on escape."""

    BINDINGS = [Binding("escape", "cancel", "Cancel")]

    def compose(self) -> ComposeResult:
        with Vertical(classes="dialog"):
            yield Static("Pin a new anchor from a file", classes="dialog-title")
            yield Static("A text file is the system prompt; a JSON file may hold "
                         '{"system": "...", "tools": [...]}. Enter to continue, escape to cancel.',
                         classes="dialog-body")
            yield Input(placeholder="path/to/system-prompt.txt", id="anchor-path")
            yield Static("", id="anchor-error", classes="dialog-error")

    def on_mount(self) -> None:
        self.query_one(Input).cursor_blink = False
        self.query_one(Input).focus()

    def on_input_submitted(self, event: Input.Submitted) -> None:
        path = Path(event.value.strip()).expanduser()
        if not event.value.strip() or not path.is_file():
            self.query_one("#anchor-error", Static).update(f"not a file: {event.value.strip() or '(empty)'}")
            return
        self.dismiss(path)

    def action_cancel(self) -> None:
        self.dismiss(None)
