"""The dashboard on the smallest terminal it supports, 80x24, driven by keys against a recorded
server (issue 27): the footer keeps Help and Quit, the help screen scrolls, Ctrl-C quits."""

from __future__ import annotations

from pathlib import Path

import pytest
from textual.containers import VerticalScroll
from textual.widgets import Footer

from tui.app import make_app
from tui.recorded import RecordedSource
from tui.screens.help import HelpScreen
from tui.testing import settle, sync

RECORDING = Path(__file__).parent / "snapshots" / "recording-tiny.json"
SMALL = (80, 24)


@pytest.fixture
def source() -> RecordedSource:
    return RecordedSource.load(RECORDING)


def footer_keys(app) -> dict[str, bool]:
    """Each footer key's description, and whether it is drawn whole inside the screen."""
    width = app.size.width
    return {key.description: key.region.right <= width and key.region.width > 0
            for key in app.screen.query_one(Footer).query("FooterKey")}


@sync
async def test_the_footer_keeps_help_and_quit_at_80_columns(source: RecordedSource) -> None:
    app = make_app(source)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        for tab in ("1", "2", "3", "4", "5"):
            await pilot.press(tab)
            await pilot.pause()
            keys = footer_keys(app)
            assert keys.get("Help") and keys.get("Quit"), (tab, keys)


@sync
async def test_the_help_screen_scrolls_to_its_end_at_80x24(source: RecordedSource) -> None:
    app = make_app(source)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
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
    app = make_app(source)
    async with app.run_test(size=SMALL) as pilot:
        await settle(pilot)
        await pilot.press("ctrl+c")
        await pilot.pause()
        assert not app.is_running
