"""What every tab offers the app (a redraw from state, the table ``/`` filters), and the entry tabs."""

from __future__ import annotations

from typing import Any, Callable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Vertical
from textual.widgets import DataTable

from tui.columns import entry_columns
from tui.messages import VerbRequested
from tui.state import DashboardState
from tui.widgets.keyed_table import KeyedTable
from tui.widgets.timeline import CheckpointTimeline


class Pane(Vertical):
    """A tab's content."""

    def update_view(self, state: DashboardState, now: float) -> None:
        """Redraw from ``state``; ``now`` is the source's clock, for ages."""

    @property
    def table(self) -> KeyedTable | None:
        """The table ``/`` filters, if the tab has one."""
        return None


class EntryPane(Pane):
    """Cache entries in a table, the selected one's checkpoints below; pin, unpin and evict act on it."""

    BINDINGS = [
        Binding("p", "verb('pin')", "Pin"),
        Binding("u", "verb('unpin')", "Unpin"),
        Binding("x,delete", "verb('evict')", "Evict"),
    ]

    def __init__(self, rows: Callable[[DashboardState], list[dict[str, Any]]], *, title: str,
                 read_only: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rows = rows
        self.table_title = title
        self.read_only = read_only
        self.now = 0.0

    def compose(self) -> ComposeResult:
        yield from self.compose_top()
        yield KeyedTable(entry_columns(lambda: self.now), lambda e: e.id, sort="last_used", reverse=True,
                         title=self.table_title, classes="entries")
        timeline = CheckpointTimeline(classes="timeline")
        timeline.border_title = "Checkpoints along the token axis"
        yield timeline

    def compose_top(self) -> ComposeResult:
        """Widgets above the table (none here)."""
        return iter(())

    @property
    def table(self) -> KeyedTable:
        return self.query_one(KeyedTable)

    def update_view(self, state: DashboardState, now: float) -> None:
        self.now = now
        self.table.show(self.rows(state))
        self._show_selected()

    def _show_selected(self) -> None:
        """The selected entry's checkpoints below the table; the timeline's height follows them,
        so the table's cursor row is scrolled back into view once that height is laid out."""
        self.query_one(CheckpointTimeline).show(self.table.selected(), self.now)
        self.call_after_refresh(self.table.keep_cursor_in_view)

    def on_data_table_row_highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_selected()

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        if action in ("verb", "new_anchor") and self.read_only:
            return False  # hidden: read-only mode offers no way to change the server
        return True

    def action_verb(self, verb: str) -> None:
        key = self.table.selected_key
        if key is None:
            self.notify("Select an entry first.", severity="warning")
            return
        self.post_message(VerbRequested(verb, key))
