"""The dashboard on the smallest terminal it supports, 80x24, driven by keys against a recorded
server (issue 27): the footer keeps Help and Quit, the help screen scrolls, Ctrl-C quits."""

from __future__ import annotations

from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any, AsyncIterator

import pytest
from textual.pilot import Pilot
from textual.containers import VerticalScroll
from textual.widgets import Footer

from tests.tui.polls import quiet_app
from tui.app import DashboardApp
from tui.recorded import RecordedSource
from tui.screens.help import HelpScreen
from tui.testing import settle, sync

RECORDING = Path(__file__).parent / "snapshots" / "recording-tiny.json"
SMALL = (80, 24)


@pytest.fixture
def source() -> RecordedSource:
    return RecordedSource.load(RECORDING)


@asynccontextmanager
async def dashboard(source: RecordedSource, **options: Any) -> AsyncIterator[tuple[DashboardApp, Pilot]]:
    """The app at 80x24, its first poll drawn; it polls only when asked (``tests.tui.polls``)."""
    app = quiet_app(source, **options)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        yield app, pilot


def footer_keys(app) -> dict[str, bool]:
    """Each footer key's description, and whether it is drawn whole inside the screen."""
    width = app.size.width
    return {key.description: key.region.right <= width and key.region.width > 0
            for key in app.screen.query_one(Footer).query("FooterKey")}


@sync
async def test_the_footer_keeps_help_and_quit_at_80_columns(source: RecordedSource) -> None:
    async with dashboard(source) as (app, pilot):
        for tab in ("1", "2", "3", "4", "5"):
            await pilot.press(tab)
            await pilot.pause()
            keys = footer_keys(app)
            assert keys.get("Help") and keys.get("Quit"), (tab, keys)


@sync
async def test_the_help_screen_scrolls_to_its_end_at_80x24(source: RecordedSource) -> None:
    async with dashboard(source) as (app, pilot):
        await pilot.press("question_mark")
        assert isinstance(app.screen, HelpScreen)
        scroll = app.screen.query_one(VerticalScroll)
        assert scroll.max_scroll_y > 0  # taller than the screen: it must scroll
        assert scroll.region.right <= SMALL[0] and scroll.region.bottom <= SMALL[1]  # not clipped
        await pilot.press("end")
        await pilot.pause()
        assert scroll.scroll_y == scroll.max_scroll_y
        await pilot.press("home", "down")
        await pilot.pause()
        assert 0 < scroll.scroll_y < scroll.max_scroll_y
        await pilot.press("escape")
        assert not isinstance(app.screen, HelpScreen)


@sync
async def test_ctrl_c_quits_as_in_htop_and_k9s(source: RecordedSource) -> None:
    async with dashboard(source) as (app, pilot):
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running


def test_the_new_anchor_estimate_counts_the_models_state_snapshot(source: RecordedSource) -> None:
    """A short prompt's anchor is mostly its fixed-size state snapshot: 9.1 KiB was estimated for
    a 57 KiB anchor when only bytes per token were counted. Now every recorded anchor is
    estimated from the other entries' real sizes within a factor of 1.5."""
    from tui import impact

    entries = source.recording["entries"]
    for anchor in (e for e in entries if e["kind"] == "anchor"):
        others = [e for e in entries if e["id"] != anchor["id"]]
        estimate = impact.Sizes.of(others).anchor_bytes(anchor["length"])
        assert anchor["bytes"] / 1.5 <= estimate <= anchor["bytes"] * 1.5, (anchor["id"], estimate, anchor["bytes"])
    sizes = impact.Sizes.of(entries)
    assert sizes.snapshot > 0 and sizes.anchor_bytes(14) > sizes.snapshot
    said = impact.new_anchor("p.txt", "You are terse. Answer in one line.", None, {}, entries)
    assert f"{render_bytes(sizes.snapshot)} state snapshot" in said.body


def render_bytes(n: int) -> str:
    from apcctl.core import render

    return render.human_bytes(n)


@sync
async def test_a_request_of_an_absorbed_entry_opens_the_entry_that_absorbed_it(source: RecordedSource) -> None:
    """The recording's second request restored c83138c67507, which its conversation's next
    entries absorbed (into 7709ace9e2f7, then 7a31f17ad2c1): said as absorbed, not "evicted",
    and the entry held now is shown."""
    from textual.widgets import TabbedContent

    from tui.messages import EntryRequested

    async with dashboard(source) as (app, pilot):
        assert app.state.entry("c83138c67507") is None and app.state.entry("7a31f17ad2c1") is not None
        app.query_one("#pane-live").post_message(EntryRequested("c83138c67507"))
        await pilot.pause()
        await pilot.pause()
        assert app.query_one(TabbedContent).active == "lineages"
        assert app.query_one("#pane-lineages").table.selected_key == "7a31f17ad2c1"
        said = [n.message for n in app._notifications]
        assert any("absorbed into 7a31f17ad2c1" in m for m in said) and not any("evicted" in m for m in said)


@sync
async def test_a_finished_restart_polls_at_once_so_the_header_is_current(source: RecordedSource) -> None:
    """After ✓ restarted the header must not keep "✕ lost … DRAINING" until the next (backed
    off) poll: the roll's end polls the server at once. The periodic poll is stopped here, so
    only that poll can come."""
    from tui.testing import ScriptedRestarter, wait_for

    async with dashboard(source, restarter=ScriptedRestarter(servers=("main",))) as (app, pilot):
        pane = app.query_one("#pane-restart")
        await pilot.press("4")
        await wait_for(pilot, lambda: bool(pane.plan))
        app.state.poll_failed("cannot reach the server: it is restarting")  # as during the stop
        app._poll_timer.stop()
        before = app.polls
        await pilot.press("R", "y")
        await wait_for(pilot, lambda: pane.result is not None)
        await wait_for(pilot, lambda: app.polls > before)
        assert app.state.connection.state == "live"


@sync
async def test_a_confirmed_evict_acts_on_the_entry_chosen_though_the_rows_moved(source: RecordedSource) -> None:
    """Sorted by LAST USED, the rows reorder under the open dialog (another entry is used): the
    evict goes to the entry the key was pressed on, and the cursor stays on it until then."""
    from tui.testing import wait_for

    async with dashboard(source) as (app, pilot):
        await pilot.press("2")
        table = app.query_one("#pane-lineages").table
        await pilot.press("down", "down")
        chosen = table.selected_key
        position = table.cursor_row
        await pilot.press("x")
        # Meanwhile the entry below the chosen one is used: it moves to the top.
        newest = max(e["last_used"] or 0 for e in source.recording["entries"])
        moved = next(key for key, _ in table._shown[position + 1:])
        next(e for e in source.recording["entries"] if e["id"] == moved)["last_used"] = newest + 60
        polls = app.polls
        app.poll_now()
        await wait_for(pilot, lambda: app.polls > polls)
        await pilot.pause()
        assert table.selected_key == chosen and table.cursor_row != position  # it moved, the cursor with it
        await pilot.press("y")
        await wait_for(pilot, lambda: source.calls == [("evict", chosen)])
