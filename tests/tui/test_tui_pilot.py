"""The dashboard driven by keys against a recorded server: dialogs, filters, sort, pause, read-only, restart.

No server here (see test_tui_server.py for that): ``RecordedSource`` answers the verbs on its
own copy and lists them in ``calls``, so each test checks what would have reached the server.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from textual.widgets import TabbedContent

from tests.tui.polls import quiet_app
from tui.app import DashboardApp
from tui.recorded import RecordedSource
from tui.screens.confirm import ConfirmScreen
from tui.source import SourceError
from tui.testing import ScriptedRestarter, recorded_fleet, settle, sync, text_of, wait_for

RECORDING = Path(__file__).parent / "snapshots" / "recording-tiny.json"
SIZE = (140, 40)


@pytest.fixture
def source() -> RecordedSource:
    return RecordedSource.load(RECORDING)


def entries_table(app: DashboardApp):
    return app.query_one("#pane-lineages").table


def first(source: RecordedSource, **match) -> str:
    return next(e["id"] for e in source.recording["entries"] if all(e.get(k) == v for k, v in match.items()))


@sync
async def test_pin_asks_first_and_cancel_changes_nothing(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        target = first(source, kind="conversation", tier="ram+disk")
        assert entries_table(app).select_key(target)
        await pilot.press("p")
        assert isinstance(app.screen, ConfirmScreen)
        assert "anchor budget" in app.screen.impact.body
        await pilot.press("n")
        assert not isinstance(app.screen, ConfirmScreen)
        await pilot.press("p", "enter")  # enter presses the focused button: Cancel
        assert source.calls == []
        await pilot.press("p", "y")
        await wait_for(pilot, lambda: source.calls == [("pin", target)])
        await wait_for(pilot, lambda: app.state.entry(target)["pinned"])
        assert entries_table(app).selected_key == target  # the cursor stayed on its entry


@sync
async def test_evict_from_the_anchors_tab_removes_the_row(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("3")
        anchors = app.query_one("#pane-anchors").table
        before = anchors.row_count
        victim = anchors.selected_key
        await pilot.press("x")
        assert "Frees an anchor slot" in app.screen.impact.body
        await pilot.press("y")
        await wait_for(pilot, lambda: anchors.row_count == before - 1)
        assert source.calls == [("evict", victim)]


@sync
async def test_read_only_offers_no_verbs(source: RecordedSource) -> None:
    app = quiet_app(source, read_only=True, restarter=ScriptedRestarter())
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2", "p", "x", "u", "3", "n", "4", "R")
        await pilot.pause()
        assert not isinstance(app.screen, ConfirmScreen)
        assert source.calls == []
        assert "READ-ONLY" in text_of(app.query_one("#header"))


@sync
async def test_new_anchor_from_a_json_file(source: RecordedSource, tmp_path: Path) -> None:
    path = tmp_path / "agent.json"
    tools = [{"type": "function", "function": {"name": "read_file", "parameters": {}}}]
    path.write_text(json.dumps({"system": "You are a careful reviewer.", "tools": tools}))
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("3", "n")
        await pilot.press(*"/does/not/exist", "enter")
        assert "not a file: /does/not/exist" in text_of(app.screen.query_one("#anchor-error"))
        app.screen.query_one("#anchor-path").value = str(path)
        await pilot.press("enter")
        assert isinstance(app.screen, ConfirmScreen)
        assert "27 characters, 1 tool)" in app.screen.impact.body
        await pilot.press("y")
        await wait_for(pilot, lambda: bool(source.calls))
        assert source.calls == [("new_anchor", {"system": "You are a careful reviewer.", "tools": tools})]


@sync
async def test_filter_narrows_inverts_and_escape_clears_and_sort_keeps_the_cursor_on_its_entry(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("2")
        table = entries_table(app)
        total = table.row_count
        anchors = sum(e["kind"] == "anchor" for e in source.recording["entries"])
        await pilot.press("slash", *"anchor")
        assert table.row_count == anchors
        await pilot.press("enter")  # keep the filter, back to the table
        assert table.has_focus and table.row_count == anchors
        await pilot.press("slash", "home", "!", "enter")
        assert table.filter_text == "!anchor" and table.row_count == total - anchors
        await pilot.press("escape")
        assert table.row_count == total and table.filter_text == ""

        # Sorting (same app: the filter is gone, the sort untouched): the cursor keeps its entry.
        await pilot.press("down", "down")
        chosen = table.selected_key
        await pilot.press("s")
        assert table.sort_column == "label"  # the column after LAST USED
        assert table.selected_key == chosen
        table.sort_by("length", reverse=True)
        lengths = [int(table.get_row_at(i)[3].plain.replace(",", "")) for i in range(table.row_count)]
        assert lengths == sorted(lengths, reverse=True)
        assert table.selected_key == chosen


@sync
async def test_pause_holds_the_screen_and_resume_catches_up(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        requests = app.query_one("#requests")
        shown = requests.row_count
        newest = max(r.data["seq"] for r in app.state.requests)
        await pilot.press("space")
        source.push("request", {**app.state.requests[-1].data, "seq": newest + 1})
        await wait_for(pilot, lambda: len(app.state.requests) == shown + 1)
        await settle(pilot)
        assert requests.row_count == shown  # held still
        await pilot.press("space")
        assert requests.row_count == shown + 1


@sync
async def test_a_lost_server_is_retried_until_it_answers(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        source.failing = "cannot reach http://127.0.0.1:1: connection refused"
        polls = app.polls
        await pilot.press("r")
        await wait_for(pilot, lambda: app.polls > polls)
        assert app.state.connection.state == "lost"
        assert "✕ lost" in text_of(app.query_one("#header"))
        source.failing = None
        await wait_for(pilot, lambda: app.state.connection.state == "live")  # the backoff timer polls again
        assert app.state.connection.reconnects == 1


@sync
async def test_restart_runs_to_done_after_a_confirmation(source: RecordedSource) -> None:
    restarter = ScriptedRestarter(servers=("main",))
    app = quiet_app(source, restarter=restarter)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        pane = app.query_one("#pane-restart")
        await pilot.press("4")
        await wait_for(pilot, lambda: bool(pane.plan))
        await pilot.press("R")
        assert isinstance(app.screen, ConfirmScreen) and "wait until nothing is in flight" in app.screen.impact.body
        await pilot.press("n")
        assert restarter.runs == 0
        await pilot.press("R", "y")
        await wait_for(pilot, lambda: pane.result is not None)
        assert pane.result.ok and [s.phase for s in pane.steps if s.phase != "plan"][-1] == "done"
        await pilot.pause()
        assert "restarted 1 server(s): main pid 4141 -> 4242" in text_of(app.query_one("#restart-progress"))


@sync
async def test_the_request_table_follows_the_newest_until_the_cursor_moves(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        requests = app.query_one("#requests")
        newest = max(r.data["seq"] for r in app.state.requests)
        pid = app.state.server.pid
        latest = app.state.requests[-1].data

        async def arrive(seq: int) -> None:
            source.push("request", {**latest, "seq": seq, "started": latest["started"] + seq - newest})
            await wait_for(pilot, lambda: app.state.requests[-1].data["seq"] == seq)
            await settle(pilot)

        await arrive(newest + 1)
        assert requests.cursor_row == 0 and requests.selected_key == f"{pid}:{newest + 1}"
        await pilot.press("down")
        held = requests.selected_key
        await arrive(newest + 2)
        assert requests.selected_key == held and requests.cursor_row == 2


SIZES = ((80, 24), (100, 30), (110, 40), (119, 40), (120, 40), (140, 40), (200, 50))


@sync
async def test_every_size_keeps_request_rows_and_both_graphs(source: RecordedSource) -> None:
    """80x24 and up: the request table keeps rows, the graphs keep columns, the header fits its width."""
    app = quiet_app(source)
    async with app.run_test(size=SIZES[0]) as pilot:
        await settle(pilot)
        for width, height in SIZES:
            await pilot.resize_terminal(width, height)
            await pilot.pause()
            requests = app.query_one("#requests")
            assert requests.content_region.height - 1 >= 5, (width, height)  # one line is the column header
            for graph in ("#spark-hits", "#spark-ttft"):
                assert app.query_one(graph).region.width >= 20, (graph, width, height)
            assert all(app.query_one(f"#gauge-{g}").region.width >= 30 for g in ("ram", "disk", "pool"))
            header = text_of(app.query_one("#header")).split("\n")
            assert len(header) == 2 and header[1].strip(), (width, header)  # nothing wrapped away
            assert ("-short" in app.screen.classes) == (height < 32)
            assert app.query_one("#live-bottom").display == (height >= 32)


@sync
async def test_a_request_row_opens_its_entry(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        tabs = app.query_one(TabbedContent)
        requests = app.query_one("#requests")
        held = {e["id"] for e in source.recording["entries"]}
        warm = next(r for r in reversed(app.state.requests) if r.data.get("entry_id") in held)
        cold = next(r for r in app.state.requests if r.data.get("restore_kind") == "cold")
        lineages = entries_table(app)
        lineages.set_query("!" + warm.data["entry_id"])  # the drill-down must clear a filter that hides it
        assert requests.select_key(warm.key)
        await pilot.press("enter")
        await pilot.pause()
        assert tabs.active == "lineages" and lineages.has_focus
        assert lineages.selected_key == warm.data["entry_id"] and lineages.filter_text == ""
        await pilot.press("1")
        assert requests.select_key(cold.key)
        await pilot.press("enter")
        await pilot.pause()
        assert tabs.active == "live"  # a cold request restored nothing: there is no entry to open
        assert any("cold request" in n.message for n in app._notifications)


@sync
async def test_t_puts_the_graphs_on_wall_clock_time_and_without_a_fleet_there_is_no_fleet_tab(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        hits = app.query_one("#spark-hits")
        requests = len(app.state.requests)
        assert f"last {requests} requests" in app.query_one("#hits-row").border_title
        assert hits.series(10) == [r.data["restored_tokens"] / r.data["prompt_tokens"]
                                   for r in list(app.state.requests)[-10:]]
        await pilot.press("t")
        assert app.query_one("#hits-row").border_title == f"Hit ratio · last 1 min: {requests} requests"
        columns = hits.series(60)  # one a second: the recording spans 40 s, so the oldest 20 are idle
        assert len(columns) == 60 and columns[0] is None and columns[-10:] != [None] * 10
        await pilot.press("t", "t", "t")
        assert "last 64 requests" in app.query_one("#ttft-row").border_title
        # Without a fleet (same app, still on the Live tab) there is no Fleet tab to go to.
        await pilot.press("6")
        assert app.query_one(TabbedContent).active == "live" and not app.query("#pane-fleet")


@sync
async def test_the_log_tab_has_a_line_per_event(source: RecordedSource) -> None:
    app = quiet_app(source)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("5")
        log = app.query_one("#event-log")
        events = len(source.recording["events"])
        await wait_for(pilot, lambda: len(log.lines) == events)
        newest = max(r.data["seq"] for r in app.state.requests)
        source.push("request", {**app.state.requests[-1].data, "seq": newest + 1, "started": source.now()})
        await wait_for(pilot, lambda: len(log.lines) == events + 1)
        assert f"#{newest + 1} " in log.lines[-1].text
        await pilot.press("space")  # paused, the log holds still too, and catches up after
        source.push("cache", {"seq": 10_000, "event": "evict", "entry_id": "gone", "length": 1,
                              "time": source.now(), "detail": "operator"})
        await wait_for(pilot, lambda: app.state.logged == events + 1 + 1)
        await settle(pilot)
        assert len(log.lines) == events + 1
        await pilot.press("space")
        assert "evict" in log.lines[-1].text and "operator" in log.lines[-1].text


class FlakyFleet:
    """The recorded fleet, or a SourceError while ``failing`` says why."""

    def __init__(self, recording: dict) -> None:
        self.fixed = recorded_fleet(recording)
        self.failing: str | None = None

    def snapshot(self):
        if self.failing:
            raise SourceError(self.failing)
        return self.fixed


@sync
async def test_the_fleet_tab_shows_each_servers_gateway_state_and_where_requests_went(source: RecordedSource) -> None:
    fleet = FlakyFleet(source.recording)
    app = quiet_app(source, fleet=fleet)
    async with app.run_test(size=SIZE) as pilot:
        await settle(pilot)
        await pilot.press("6")
        assert app.query_one(TabbedContent).active == "fleet"
        servers = app.query_one("#fleet-servers")
        shown = text_of(servers)
        for name, state in (("fleet-1", "healthy"), ("fleet-2", "draining"), ("fleet-3", "absent")):
            row = next(line for line in shown.splitlines() if name in line)
            assert state in row, row
        assert "unreachable" in next(line for line in shown.splitlines() if "fleet-3" in line)
        assert "1 of 3 servers healthy" in text_of(app.query_one("#fleet-gateway"))
        requests = app.query_one("#fleet-requests")
        recorded = [d for n, d in source.recording["events"] if n == "request"]
        assert requests.row_count == min(len(recorded), 60)
        newest = requests.selected()  # newest first: the last recorded request, dealt to its server
        assert newest.data["seq"] == recorded[-1]["seq"] and newest.data["server"] == f"fleet-{1 + (len(recorded) - 1) % 2}"
        # A failed fleet poll keeps the last view and says why; the backoff polls again by itself.
        fleet.failing = "cannot reach http://127.0.0.1:30000: connection refused"
        polls = app.fleet_polls
        await pilot.press("r")
        await wait_for(pilot, lambda: app.fleet_polls > polls)
        assert "last poll failed: cannot reach" in text_of(app.query_one("#fleet-gateway"))
        assert servers.row_count == 3
        fleet.failing = None
        await wait_for(pilot, lambda: app.state.fleet_error == "")


@sync
async def test_the_restart_tab_follows_the_roll_from_server_to_server(source: RecordedSource) -> None:
    restarter = ScriptedRestarter(servers=("fleet-1", "fleet-2", "fleet-3"), hold_at=2, hold_server="fleet-2")
    app = quiet_app(source, restarter=restarter, fleet=FlakyFleet(source.recording))
    async with app.run_test(size=SIZE) as pilot:
        restarter.abandon = app.closing
        await settle(pilot)
        pane = app.query_one("#pane-restart")
        await pilot.press("4")
        await wait_for(pilot, lambda: bool(pane.plan))
        await pilot.press("R")
        assert "out of the gateway" in app.screen.impact.body and "back in the gateway" in app.screen.impact.body
        await pilot.press("y")
        await wait_for(pilot, restarter.held.is_set)
        await wait_for(pilot, lambda: pane.steps[-1].server == "fleet-2")
        await pilot.pause()
        lines = text_of(app.query_one("#restart-progress")).splitlines()
        row = {name: next(line for line in lines if name in line) for name in ("fleet-1", "fleet-2", "fleet-3")}
        assert "✓ done" in row["fleet-1"] and "● wait idle" in row["fleet-2"], row
        assert "waiting its turn" in row["fleet-3"], row
        restarter.release()
        await wait_for(pilot, lambda: pane.result is not None)
        assert pane.result.ok and [s.server for s in pane.result.servers] == ["fleet-1", "fleet-2", "fleet-3"]
