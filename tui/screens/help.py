"""``?``: every key, and what each tab is for."""

from __future__ import annotations

from typing import Iterable

from rich.console import Group
from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

KEYS: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = (
    ("Anywhere", (
        ("1 2 3 4 5 6", "Live, Lineages, Anchors, Restart, Log tabs; Fleet with apcctl fleet top"),
        ("/", "filter the tab's table (substring; !text hides matches); enter keeps it, escape clears"),
        ("space", "pause: data keeps coming, the screen holds still; space again catches up"),
        ("r", "refresh now"),
        ("+ -", "refresh interval (0.5 s to 10 s)"),
        ("ctrl+p", "command palette"),
        ("?", "this help (up/down, pgup/pgdn, home/end scroll it)"),
        ("q ctrl+c", "quit"),
    )),
    ("Tables", (
        ("up down pgup pgdn", "move the cursor (it stays on its entry while data refreshes)"),
        ("s / S", "sort by the next column / reverse; or click a column header"),
        ("left right", "scroll a table wider than the screen"),
    )),
    ("Live", (
        ("enter", "open the selected request's entry in the Lineages tab (or click the row)"),
        ("t", "graphs per request, or over the last minute, 10 minutes, hour of wall-clock time"),
    )),
    ("Lineages and Anchors (not in read-only mode)", (
        ("p", "pin the selected entry as an anchor"),
        ("u", "unpin the selected anchor"),
        ("x / delete", "evict the selected entry from RAM and disk"),
        ("n", "pin a new anchor from a file (Anchors tab)"),
    )),
    ("Restart (not in read-only mode)", (
        ("R", "start the idle-checked rolling restart"),
    )),
)

TABS = (
    ("Live", "budgets (conversation RAM, anchors, disk, buffer pool), counters, hit ratio and time-to-first-token "
             "graphs, the latest requests with where their time went, and cache events (below 32 rows: in Log)."),
    ("Lineages", "every entry: conversations and anchors, in RAM or on disk. The selected one's checkpoints sit "
                 "on its token axis: a restore starts at one of them or at the end."),
    ("Anchors", "pinned system-prompt-and-tools prefixes shared across sessions, against their caps."),
    ("Restart", "drain, wait for in-flight requests, flush to disk, restart, wait ready, probe an anchor."),
    ("Log", "every event of the server's event stream, one line each: requests, cache events, the dashboard's "
            "own notes (server lost, back, restarted)."),
    ("Fleet", "with apcctl fleet top: each server's state in the gateway (healthy, draining, absent) beside its "
              "own in flight, hit ratio and budgets, and the server each recent request went to."),
)


def _section(title: str, rows: Iterable[tuple[str, str]]) -> Group:
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True, width=18)
    grid.add_column()
    for key, what in rows:
        grid.add_row(key, what)
    return Group(Text(title, style="bold underline"), grid, Text(""))


def help_text() -> Group:
    return Group(*(_section(title, rows) for title, rows in KEYS), _section("Tabs", TABS))


class HelpScreen(ModalScreen[None]):
    """The keys, in a dialog that fits the screen and scrolls (up/down, pgup/pgdn, home/end)."""

    BINDINGS = [Binding("escape,question_mark,q", "dismiss", "Close")]
    AUTO_FOCUS = "VerticalScroll"  # the arrow and page keys scroll it

    def compose(self) -> ComposeResult:
        with VerticalScroll(classes="dialog help"):
            yield Static("apcctl top: keys", classes="dialog-title")
            yield Static(help_text())
