"""``fleet top``'s server picker: Enter on a Fleet row, and every other tab shows that server.

Recorded servers (``RecordedSource``), driven by Textual's pilot as ``test_tui_pilot.py`` does;
``fleet top`` without ``--server`` opens on the server the gateway sent the most requests to.
"""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

from textual.widgets import TabbedContent

from tui.app import make_app
from tui.fleet import FleetSnapshot, busiest
from tui.recorded import RecordedSource
from tui.testing import recorded_fleet, settle, sync, text_of, wait_for

RECORDING = Path(__file__).parent / "snapshots" / "recording-tiny.json"
SIZE = (140, 40)


class PickableFleet:
    """The recorded fleet; each server it is asked for is a recording of its own (another pid)."""

    def __init__(self, recording: dict) -> None:
        self.recording = recording
        self.fixed = recorded_fleet(recording)
        self.asked: list[str] = []

    def snapshot(self) -> FleetSnapshot:
        return self.fixed

    def source_for(self, name: str) -> RecordedSource | None:
        server = next((s for s in self.fixed.servers if s.name == name), None)
        if server is None:
            return None
        self.asked.append(name)
        own = copy.deepcopy(self.recording)
        own["status"]["server"]["pid"] += 1000 * int(name[-1])
        return RecordedSource(own, name=server.url)


@sync
async def test_enter_on_a_fleet_row_makes_every_other_tab_show_that_server() -> None:
    first = RecordedSource.load(RECORDING)
    first.name = "http://127.0.0.1:30001"  # fleet-1, as fleet top opens it
    fleet = PickableFleet(first.recording)
    app = make_app(first, fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("6")
        assert "the other tabs show fleet-1" in text_of(app.query_one("#fleet-gateway"))
        servers = app.query_one("#fleet-servers")
        servers.focus()
        assert servers.select_key("fleet-2")
        await pilot.press("enter")
        await wait_for(pilot, lambda: app.source.name == "http://127.0.0.1:30002")
        await settle(pilot)
        assert fleet.asked == ["fleet-2"]
        assert app.query_one(TabbedContent).active == "live"
        pid = first.recording["status"]["server"]["pid"] + 2000
        assert app.state.status.server.pid == pid  # the Live tab's numbers are fleet-2's own
        assert "http://127.0.0.1:30002" in text_of(app.query_one("#header"))
        # Back on the Fleet tab, the box names the server the other tabs follow now.
        await pilot.press("6")
        await wait_for(pilot, lambda: "the other tabs show fleet-2" in text_of(app.query_one("#fleet-gateway")))
        # The first server's stream is over: nothing it said is drawn any more.
        assert app.source is not first


@sync
async def test_a_fixed_fleet_view_says_it_cannot_switch() -> None:
    source = RecordedSource.load(RECORDING)
    fleet = PickableFleet(source.recording)
    fleet.source_for = lambda name: None  # type: ignore[method-assign]
    app = make_app(source, fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("6")
        servers = app.query_one("#fleet-servers")
        servers.focus()
        assert servers.select_key("fleet-2")
        await pilot.press("enter")
        await pilot.pause()
        assert app.source is source and app.query_one(TabbedContent).active == "fleet"


def test_fleet_top_opens_on_the_server_the_gateway_sent_the_requests_to() -> None:
    recording = RecordedSource.load(RECORDING).recording
    fleet = recorded_fleet(recording)
    one, two, three = fleet.servers
    busy = copy.deepcopy(two.status)
    busy["hits"] = {**busy["hits"], "requests": one.hits.requests + 5}
    assert busiest(replace(fleet, servers=[one, replace(two, status=busy), three])) == "fleet-2"
    assert busiest(fleet) == "fleet-1"  # a tie: the first
    assert busiest(replace(fleet, servers=[three])) is None  # nobody answers
