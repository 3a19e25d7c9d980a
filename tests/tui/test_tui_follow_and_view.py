"""Issue 36: the Live table follows the newest request until paused and Home/g resume it; the
Lineages cursor stays in view as the timeline below it grows; the evict notification speaks the
dialog's units. Driven by keys against the recorded server (``RecordedSource``)."""

from __future__ import annotations

from pathlib import Path

import pytest

from apcctl.core import render
from tests.tui.polls import quiet_app
from tui.app import DashboardApp
from tui.recorded import RecordedSource
from tui.testing import settle, sync, wait_for

RECORDING = Path(__file__).parent / "snapshots" / "recording-tiny.json"


@pytest.fixture
def source() -> RecordedSource:
    return RecordedSource.load(RECORDING)


async def _arrive(pilot, app: DashboardApp, source: RecordedSource, seq: int) -> None:
    latest = app.state.requests[-1].data
    source.push("request", {**latest, "seq": seq, "started": latest["started"] + 1})
    await wait_for(pilot, lambda: app.state.requests[-1].data["seq"] == seq)
    await settle(pilot)


@pytest.mark.parametrize("key", ["home", "g"])
@sync
async def test_home_and_g_go_back_to_the_newest_request_and_follow_again(source: RecordedSource, key: str) -> None:
    app = quiet_app(source)
    async with app.run_test(size=(140, 40)) as pilot:
        await settle(pilot)
        requests = app.query_one("#requests")
        pid, newest = app.state.server.pid, max(r.data["seq"] for r in app.state.requests)
        assert requests.following and "● following" in requests.border_title
        await pilot.press("down", "down")
        assert not requests.following and "paused" in requests.border_title
        held = requests.selected_key
        await _arrive(pilot, app, source, newest + 1)
        assert requests.selected_key == held  # paused: the cursor stays on its request
        requests.sort_by("ttft")  # another order: Home/g also brings back newest first
        await pilot.press(key)
        assert requests.following and "● following" in requests.border_title
        assert (requests.sort_column, requests.sort_reverse) == ("started", True)
        assert requests.cursor_row == 0 and requests.selected_key == f"{pid}:{newest + 1}"
        await _arrive(pilot, app, source, newest + 2)
        assert requests.cursor_row == 0 and requests.selected_key == f"{pid}:{newest + 2}"  # following again


@sync
async def test_moving_back_to_the_first_row_follows_again(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=(140, 40)) as pilot:
        await settle(pilot)
        requests = app.query_one("#requests")
        await pilot.press("down")
        assert not requests.following
        await pilot.press("up")
        assert requests.following


@sync
async def test_the_described_entry_stays_in_view_as_the_timeline_grows(source: RecordedSource) -> None:
    """The timeline under the table is as tall as the selected entry's checkpoints need: moving
    onto a long one shrinks the table, and its cursor row must still be shown."""
    app = quiet_app(source)
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("2")
        table = app.query_one("#pane-lineages").table
        heights = set()
        for row in range(table.row_count):
            await pilot.press("down" if row else "g")
            await settle(pilot)
            heights.add(table.size.height)
            shown = table.scrollable_content_region.height - 1  # the column header's line
            assert table.scroll_y <= table.cursor_row < table.scroll_y + shown, (row, table.scroll_y, shown)
        assert len(heights) > 1  # the table did change height along the way (else this proves nothing)


@sync
async def test_the_evict_notification_speaks_the_dialogs_units(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=(140, 40)) as pilot:
        await settle(pilot)
        await pilot.press("3")
        anchors = app.query_one("#pane-anchors").table
        victim = app.state.entry(anchors.selected_key)
        freed = (victim.bytes or 0) + (victim.disk_bytes or 0)
        await pilot.press("x")
        assert render.human_bytes(victim.bytes) in app.screen.impact.body  # the dialog's units
        await pilot.press("y")
        await wait_for(pilot, lambda: any("freed" in n.message for n in app._notifications))
        said = next(n.message for n in app._notifications if "freed" in n.message)
        assert f"freed {render.human_bytes(freed)}" in said and "bytes" not in said


@sync
async def test_a_new_servers_first_request_says_why_the_table_waits(source: RecordedSource) -> None:
    source.recording["events"] = [e for e in source.recording["events"] if e[0] != "request"]
    source.recording["status"]["idle"]["in_flight"] = 1
    app = quiet_app(source)
    async with app.run_test(size=(140, 40)) as pilot:
        await settle(pilot)
        requests = app.query_one("#requests")
        assert not app.state.requests and "MLX compiles its kernels" in str(requests.border_subtitle)
        source.recording["status"]["idle"]["in_flight"] = 0
        await pilot.press("r")
        await wait_for(pilot, lambda: not requests.border_subtitle)


@sync
async def test_the_callers_notices_are_shown_once(source: RecordedSource) -> None:
    said = {"now": ""}
    app = quiet_app(source, notices=lambda: said["now"])
    async with app.run_test(size=(140, 40)) as pilot:
        await settle(pilot)
        said["now"] = "demo: traffic done: 60 requests sent (0 failed)"
        for _ in range(2):
            polls = app.polls
            await pilot.press("r")
            await wait_for(pilot, lambda: app.polls > polls)
        assert [n.message for n in app._notifications].count(said["now"]) == 1


@pytest.mark.parametrize("width", range(28, 61))  # a budgets gauge is 30 wide at least (80x24)
def test_a_gauge_never_cuts_its_numbers(width: int) -> None:
    from tui.widgets.gauge import gauge_text

    numbers = f"{render.human_bytes(12.3 * 2**20)} / {render.human_bytes(48 * 2**30)}"
    line = gauge_text("conversations ", 12.3 * 2**20, 48 * 2**30, width, detail="3 entries").plain
    assert numbers in line and len(line) <= width, line


@sync
async def test_a_value_that_grows_in_place_widens_its_column() -> None:
    """Rows whose values change but not their order are updated cell by cell: ``healthy`` ->
    ``draining`` and ``1.0 MiB`` -> ``1.0 GiB`` must show whole, not ``drainin`` (issue 36.14)."""
    from textual.app import App, ComposeResult

    from tui.widgets.keyed_table import Column, KeyedTable

    columns = [Column("name", "SERVER", lambda r: r[0]), Column("state", "GATEWAY", lambda r: r[1]),
               Column("ram", "RAM", lambda r: r[2], numeric=True)]

    class OneTable(App):
        def compose(self) -> ComposeResult:
            yield KeyedTable(columns, lambda r: r[0])

    app = OneTable()
    async with app.run_test(size=(120, 10)) as pilot:
        table = app.query_one(KeyedTable)
        table.show([("fleet-1", "ok", "1 B")])
        await pilot.pause()
        table.show([("fleet-1", "draining", "1.0 GiB / 48.0 GiB")])
        await pilot.pause()
        for key, value in (("state", "draining"), ("ram", "1.0 GiB / 48.0 GiB")):
            assert table.columns[key].content_width >= len(value), (key, table.columns[key].content_width)


def test_the_fleet_counts_pinned_anchors_wherever_they_are(source: RecordedSource) -> None:
    from tui.panes.fleet import server_columns
    from tui.testing import recorded_fleet

    server = recorded_fleet(source.recording).servers[0]
    budgets = server.budgets
    budgets["pinned_on_disk"] = 2  # after a restart: two anchors only on disk until a request restores them
    anchors = next(c for c in server_columns() if c.key == "anchors")
    assert anchors.cell(server) == f"{budgets['anchor_count'] + 2} / {budgets['anchor_count_limit']}"
