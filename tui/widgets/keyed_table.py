"""A DataTable fed whole row lists, keyed by a stable id, with sorting and a ``/`` filter.

Rows are keyed by the record's id, never by position, so the cursor stays on the same entry
while the data underneath refreshes every second. When only values change, cells are updated
in place; when the order or the set of rows changes, the table is rebuilt and the cursor put
back on its key. Sorting uses each column's raw value (bytes as numbers, not "1.2 MiB").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Generic, Sequence, TypeVar

from rich.text import Text
from textual.binding import Binding
from textual.coordinate import Coordinate
from textual.widgets import DataTable

Row = TypeVar("Row")


@dataclass(frozen=True)
class Column(Generic[Row]):
    """One column: how to show a row's cell, and what to sort it by."""

    key: str
    label: str
    cell: Callable[[Row], str | Text]
    sort: Callable[[Row], Any] | None = None  # None: not sortable
    numeric: bool = False


def _sort_key(value: Any) -> tuple[int, Any]:
    """``None`` sorts below every value, so missing data never raises."""
    return (0, 0) if value is None else (1, value)


def matches(text: str, query: str) -> bool:
    """k9s-style filter: case-insensitive substring; ``!`` in front inverts it."""
    query = query.strip()
    if not query:
        return True
    inverse = query.startswith("!")
    needle = query[1:].lower() if inverse else query.lower()
    return (needle in text.lower()) != inverse


class KeyedTable(DataTable, Generic[Row]):
    """Rows from ``show(rows)``; ``s``/``S`` sort, the app's ``/`` calls ``set_query``.

    With ``follow``, the table follows: its cursor stays on the first row of its own order (the
    newest, for a newest-first table) as rows arrive, like top. Moved off it (or sorted another
    way) it pauses, its cursor staying on its row; ``Home``/``g`` (or moving back to the first
    row) resumes following. The title says which (``● following`` / ``❚❚ paused``).

    The cursor's row stays in view when the table's height changes (the entry tabs' timeline
    grows with the entry it describes).
    """

    BINDINGS = [
        ("s", "cycle_sort", "Sort"),
        ("S", "reverse_sort", "Reverse"),
        Binding("home,g", "first_row", "First row / newest", show=False),
    ]

    def __init__(self, columns: Sequence[Column[Row]], row_key: Callable[[Row], str], *,
                 sort: str | None = None, reverse: bool = False, title: str = "", follow: bool = False,
                 **kwargs: Any) -> None:
        super().__init__(cursor_type="row", zebra_stripes=True, **kwargs)
        self.spec = list(columns)
        self.row_key = row_key
        self.sort_column = sort
        self.sort_reverse = reverse
        self.filter_text = ""
        self.caption = title
        self.follow = follow  # the table may follow its first row as new rows arrive (like top)
        self.following = follow  # ... and does now (paused once the cursor moved off it)
        self._own_order = (sort, reverse)  # the order it follows in
        self._placing = False  # the table itself moves the cursor (a rebuild), not the user
        self._rows: list[Row] = []
        self._shown: list[tuple[str, tuple[Text, ...]]] = []

    def on_mount(self) -> None:
        for column in self.spec:
            self.add_column(column.label, key=column.key)
        self._render_title()

    # ------------------------------------------------------------------ data

    def show(self, rows: Sequence[Row]) -> None:
        """Replace the data; the table redraws only what changed."""
        self._rows = list(rows)
        self._refresh_rows()

    def set_query(self, query: str) -> None:
        self.filter_text = query
        self._refresh_rows()

    @property
    def selected_key(self) -> str | None:
        if not self.row_count:
            return None
        return self.coordinate_to_cell_key(self.cursor_coordinate).row_key.value

    def selected(self) -> Row | None:
        key = self.selected_key
        return next((r for r in self._rows if self.row_key(r) == key), None)

    def select_key(self, key: str) -> bool:
        """Put the cursor on ``key`` if that row is shown."""
        for index, (shown_key, _) in enumerate(self._shown):
            if shown_key == key:
                self.move_cursor(row=index)
                return True
        return False

    def _visible(self) -> list[tuple[str, tuple[Text, ...]]]:
        rows = self._rows
        column = next((c for c in self.spec if c.key == self.sort_column and c.sort), None)
        if column is not None:
            rows = sorted(rows, key=lambda r: _sort_key(column.sort(r)), reverse=self.sort_reverse)
        built = [(self.row_key(r), tuple(self._cell(c, r) for c in self.spec)) for r in rows]
        return [(key, cells) for key, cells in built
                if matches(" ".join(c.plain for c in cells), self.filter_text)]

    @staticmethod
    def _cell(column: Column[Row], row: Row) -> Text:
        """Always ``Text``: a plain string would be read as markup, and labels hold brackets."""
        value = column.cell(row)
        if isinstance(value, Text):
            return value
        return Text(str(value), justify="right" if column.numeric else "left")

    def _refresh_rows(self) -> None:
        if not self.columns:  # not mounted yet: on_mount adds the columns, the next show fills
            return
        visible = self._visible()
        if [k for k, _ in visible] == [k for k, _ in self._shown]:
            for (key, cells), (_, before) in zip(visible, self._shown):
                for column, cell, old in zip(self.spec, cells, before):
                    if cell != old:  # a longer value widens its column (never "drainin", "1.0 Gi")
                        self.update_cell(key, column.key, cell, update_width=True)
        else:
            selected = None if self.following else self.selected_key
            self._placing = True
            try:
                self.clear()
                for key, cells in visible:
                    self.add_row(*cells, key=key)
                self._shown = visible
                if selected is None or not self.select_key(selected):
                    self.move_cursor(row=0)
            finally:
                self._placing = False
        self._shown = visible
        self._render_title()

    # ------------------------------------------------------------------ following

    def watch_cursor_coordinate(self, old: Coordinate, new: Coordinate) -> None:
        super().watch_cursor_coordinate(old, new)
        if self.follow and not self._placing and old.row != new.row:
            self._set_following(new.row == 0 and (self.sort_column, self.sort_reverse) == self._own_order)

    def action_first_row(self) -> None:
        """``Home``/``g``: the first row; a following table goes back to its own order (newest
        first) and follows again."""
        if self.follow:
            self.sort_column, self.sort_reverse = self._own_order
            self._set_following(True)
            self._refresh_rows()
        self.move_cursor(row=0)

    def _set_following(self, following: bool) -> None:
        if following != self.following:
            self.following = following
            self._render_title()

    def on_resize(self) -> None:
        self.keep_cursor_in_view()

    def keep_cursor_in_view(self) -> None:
        """Scroll the cursor's row into view (after a change of height: a resize, or a widget
        next to the table that grew)."""
        if self.row_count:
            self._scroll_cursor_into_view()

    # ------------------------------------------------------------------ sorting

    def sort_by(self, key: str, reverse: bool | None = None) -> None:
        if not any(c.key == key and c.sort for c in self.spec):
            return
        if reverse is None:
            reverse = not self.sort_reverse if key == self.sort_column else False
        self.sort_column, self.sort_reverse = key, reverse
        if self.follow:  # another order has no newest row to follow: paused on the row it is on
            self._set_following(self.following and (key, reverse) == self._own_order)
        self._refresh_rows()

    def action_cycle_sort(self) -> None:
        keys = [c.key for c in self.spec if c.sort]
        if keys:
            index = keys.index(self.sort_column) + 1 if self.sort_column in keys else 0
            self.sort_by(keys[index % len(keys)], reverse=self.sort_reverse)

    def action_reverse_sort(self) -> None:
        if self.sort_column is not None:
            self.sort_by(self.sort_column, reverse=not self.sort_reverse)

    def on_data_table_header_selected(self, event: DataTable.HeaderSelected) -> None:
        event.stop()
        self.sort_by(str(event.column_key.value))

    def _render_title(self) -> None:
        parts = [self.caption] if self.caption else []
        shown, total = len(self._shown), len(self._rows)
        parts.append(f"{shown} of {total}" if self.filter_text else f"{total}")
        label = next((c.label for c in self.spec if c.key == self.sort_column), None)
        if label:
            parts.append(f"by {label} {'▼' if self.sort_reverse else '▲'}")
        if self.filter_text:
            parts.append(f"filter {self.filter_text!r}")
        if self.follow:
            parts.append("● following" if self.following else "❚❚ paused: Home/g follows")
        self.border_title = " · ".join(parts)
