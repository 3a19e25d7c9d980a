"""The Log tab: every event of ``/admin/events`` as one line, oldest first, newest at the bottom.

Requests (with their restore and where their time went), cache events (store, absorb,
checkpoint, thin, evict, pin, disk writes) and the dashboard's own notes (the server lost,
back, restarted) in the order they came. The pane writes only the items it has not written
yet, so a pause (or a hidden tab) loses nothing.
"""

from __future__ import annotations

from rich.text import Text
from textual.app import ComposeResult
from textual.widgets import RichLog

from apcctl.core import render
from tui.columns import kind_text
from tui.panes.base import Pane
from tui.state import DashboardState, LogItem, LOG_LINES, reuse_fraction


def request_line(e: dict) -> Text:
    text = Text(f"{render.clock(e.get('started'))} ", style="grey62")
    text.append(f"{'request':<11}", style="bold")
    text.append(f" #{e.get('seq', '?')} ")
    text.append_text(kind_text(e.get("restore_kind", "?"), render.restore_label(e)))
    text.append(f" {e.get('entry_id') or '-'} restored {e.get('restored_tokens') or 0:,} of "
                f"{e.get('prompt_tokens') or 0:,} ({100 * reuse_fraction(e):.0f}%)")
    text.append(f"  ttft {render.ms(e.get('ttft_ms'))} ms = lookup {render.ms(e.get('lookup_ms'))} · admit "
                f"{render.ms(e.get('admission_ms'))} · prefill {render.ms(e.get('prefill_ms'))} · commit "
                f"{render.ms(e.get('commit_ms'))}", style="grey62")
    return text


def cache_line(e: dict) -> Text:
    text = Text(f"{render.clock(e.get('time'))} ", style="grey62")
    text.append(f"{e.get('event', '?'):<11}", style="bold cyan")
    size = f" {render.human_bytes(e['bytes'])}" if e.get("bytes") else ""
    text.append(f" {e.get('entry_id', '-')} @{e.get('length', 0):,}{size}")
    if e.get("detail"):
        text.append(f"  {e['detail']}", style="grey62")
    return text


def note_line(e: dict) -> Text:
    text = Text(f"{render.clock(e.get('time')) if e.get('time') else '--:--:--'} ", style="grey62")
    text.append(f"{'dashboard':<11}", style="bold")
    text.append(f" {e.get('text', '')}", style=e.get("style") or "")
    return text


def when(item: LogItem) -> float:
    """When it happened (a note without a time sorts after the events it came with)."""
    at = item.data.get("started" if item.kind == "request" else "time")
    return float(at) if at is not None else float("inf")


def log_line(item: LogItem) -> Text:
    return {"request": request_line, "cache": cache_line}.get(item.kind, note_line)(item.data)


class LogPane(Pane):
    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.written = 0  # the ``LogItem.number`` of the last line written

    def compose(self) -> ComposeResult:
        log = RichLog(max_lines=LOG_LINES, wrap=False, markup=False, highlight=False, auto_scroll=True, id="event-log")
        log.border_title = "Events: requests, cache events, the dashboard's notes"
        yield log

    def on_show(self) -> None:
        """Lines written while the tab was hidden are laid out now: show the newest."""
        log = self.query_one(RichLog)
        self.call_after_refresh(log.scroll_end, animate=False)

    def update_view(self, state: DashboardState, now: float) -> None:
        self.update_stream(state)

    def update_stream(self, state: DashboardState) -> None:
        log = self.query_one(RichLog)
        fresh = [item for item in list(state.log) if item.number > self.written]
        # A (re)connection replays the server's rings, cache events first: put each batch in time order.
        for item in sorted(fresh, key=when):
            log.write(log_line(item))
        if fresh:
            self.written = fresh[-1].number
            # Once laid out (a horizontal scrollbar may take a row), the newest line must still show.
            self.call_after_refresh(log.scroll_end, animate=False)
        log.border_subtitle = f"{state.logged:,} lines"
