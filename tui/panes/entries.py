"""The Lineages and Anchors tabs: the same entry table, over all entries or the anchors only."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.widgets import Static

from apcctl.core import render
from tui.messages import NewAnchorRequested
from tui.panes.base import EntryPane
from tui.state import DashboardState


class LineagesPane(EntryPane):
    def __init__(self, **kwargs: Any) -> None:
        super().__init__(lambda state: state.entries, title="Lineage entries", **kwargs)


def anchor_summary(state: DashboardState) -> Text:
    b, stats = state.budgets, state.stats
    text = Text()
    for name, value in (
        ("pinned", f"{b.pinned if b else 0} of {b.anchor_count_limit if b else 0}"
                   + (f" ({b.pinned_on_disk} only on disk)" if b and b.pinned_on_disk else "")),
        ("RAM", f"{render.human_bytes(b.anchor_bytes if b else 0)} of "
                f"{render.human_bytes(b.anchor_bytes_limit if b else 0)}"),
        ("anchor hits", f"{stats.get('hits_anchor', 0):,}"),
        ("captured", f"{stats.get('anchors_pinned', 0):,}"),
    ):
        text.append(f"{name} ", style="grey62")
        text.append(f"{value}   ", style="bold")
    return text


class AnchorsPane(EntryPane):
    BINDINGS = [Binding("n", "new_anchor", "New anchor from file")]

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(lambda state: state.anchors(), title="Anchors", **kwargs)

    def compose_top(self) -> ComposeResult:
        yield Static(classes="anchor-summary")

    def update_view(self, state: DashboardState, now: float) -> None:
        self.query_one(".anchor-summary", Static).update(anchor_summary(state))
        super().update_view(state, now)

    def action_new_anchor(self) -> None:
        self.post_message(NewAnchorRequested())
