"""SVG snapshots of the dashboard's screens, from a recorded server so every pixel is deterministic.
Most are at 140x40; the Live and Log tabs also at 80x24 (the smallest supported) and 120x40.

The recording (tests/tui/snapshots/recording-tiny.json) is 64 requests of agent-like traffic on the
tiny model, taken with ``tui.recorded.record``. Update after a deliberate change with
``pytest tests/tui/test_tui_snapshots.py --snapshot-update`` and look at the SVGs before committing.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import pytest

from server_patch.admin.schema import RequestRecord
from tui.app import DashboardApp, make_app
from tui.recorded import RecordedSource
from tui.fleet import StaticFleetSource
from tui.testing import ScriptedRestarter, recorded_fleet, settle, wait_for

RECORDING = Path(__file__).parent / "snapshots" / "recording-tiny.json"
SIZE = (140, 40)


@pytest.fixture(autouse=True)
def utc(monkeypatch: pytest.MonkeyPatch):
    """Clock columns are local time: pin the zone so the snapshots match everywhere."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def recorded_app(**kwargs) -> DashboardApp:
    return make_app(RecordedSource.load(RECORDING), **kwargs)


def after(*keys: str):
    async def run_before(pilot) -> None:
        await settle(pilot)
        for key in keys:
            await pilot.press(key)
            await pilot.pause()
        await settle(pilot)

    return run_before


def test_live_tab(snap_compare) -> None:
    """Header, budgets, sparklines, the request table, counters and cache events."""
    assert snap_compare(recorded_app(), terminal_size=SIZE, run_before=after())


# Requests as a server with the live oracle (issue 26) records them, after the recording's (which
# predates it: its rows show ``-``). (prompt, kind, restored, oracle, lost, lost_why)
ORACLE_REQUESTS = ((346, "entry", 345, 336, {}, ""), (358, "final", 292, 352, {"thinning": 60}, ""),
                   (254, "cold", 0, 240, {"ram budget": 240}, ""),
                   (300, "anchor", 198, 288, {"operator": 64, "no restore point": 26}, ""),
                   (310, "anchor", 198, 304, {"disk rejected": 106}, "hash"))


def oracle_requests(recording: dict) -> list[dict]:
    """``ORACLE_REQUESTS`` as request events following the recording's last request."""
    last = [data for name, data in recording["events"] if name == "request"][-1]
    records = []
    for n, (prompt, kind, restored, oracle, lost, why) in enumerate(ORACLE_REQUESTS, start=1):
        record = {**last, "seq": last["seq"] + n, "started": last["started"] + n / 2, "prompt_tokens": prompt,
                  "restore_kind": kind, "restored_tokens": restored, "entry_id": "" if kind == "cold" else last["entry_id"],
                  "oracle": oracle, "lost": lost, "lost_why": why}
        assert RequestRecord.from_json(record).oracle == oracle  # the typed record's shape
        assert sum(lost.values()) == max(0, oracle - restored)
        records.append(record)
    return records


def oracle_totals(records: list[dict]) -> dict:
    """``/admin/status``'s ``oracle`` over ``records`` (``lineage.misses.summarize``)."""
    from server_patch.lineage.misses import summarize

    counts: Counter[str] = Counter()
    for r in records:
        counts.update({"requests": 1, "oracle_tokens": r["oracle"], "restored_tokens": min(r["restored_tokens"], r["oracle"]),
                       **{f"lost:{reason}": n for reason, n in r["lost"].items()}})
    return {"enabled": True, **summarize(counts)}


def test_live_tab_with_the_oracle_columns(snap_compare) -> None:
    """Each request's oracle and its top lost reason ("ram 240", "evicted 64+" for two reasons),
    the recording's older rows showing ``-``; the counters' oracle line."""
    source = RecordedSource.load(RECORDING)
    pushed = oracle_requests(source.recording)
    source.recording["status"]["oracle"] = oracle_totals(pushed)  # the counters' oracle line
    app = make_app(source)

    async def run_before(pilot) -> None:
        await settle(pilot)
        for record in pushed:
            source.push("request", record)
        await wait_for(pilot, lambda: pilot.app.state.requests[-1].data["seq"] == pushed[-1]["seq"])
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


# Requests as a server with issue 29's waits records them: (ms waited by work, ended). The last
# one's row is still running when it is pushed; its ``request_ended`` follows with the final waits.
WAIT_REQUESTS = (({}, True), ({"prefill": 2908.0, "commit": 5.4, "restore": 1.0}, True),
                 ({"commit": 2.2}, True), ({"prefill": 640.0}, False))
FINAL_WAITS = {"prefill": 4210.0, "commit": 12.5}


def test_live_tab_with_the_wait_column(snap_compare) -> None:
    """Each request's WAIT (what other requests' work held it up, and what most of it was:
    "2,914 prefill+"), blank for one nothing held up, ``-`` for the recording's older rows; the
    still-running row brought up to date by its ``request_ended`` event."""
    source = RecordedSource.load(RECORDING)
    last = [data for name, data in source.recording["events"] if name == "request"][-1]
    pushed = [{**last, "seq": last["seq"] + n, "started": last["started"] + n / 2,
               "waited_ms": sum(waited.values()), "waited": waited, "delayed_steps": len(waited), "ended": ended}
              for n, (waited, ended) in enumerate(WAIT_REQUESTS, start=1)]
    final = {**pushed[-1], "waited_ms": sum(FINAL_WAITS.values()), "waited": FINAL_WAITS, "ended": True}
    assert RequestRecord.from_json(final).waited == FINAL_WAITS  # the typed record's shape
    app = make_app(source)

    async def run_before(pilot) -> None:
        await settle(pilot)
        for record in pushed:
            source.push("request", record)
        source.push("request_ended", final)
        await wait_for(pilot, lambda: pilot.app.state.requests[-1].data.get("ended") is True)
        await settle(pilot)

    assert snap_compare(app, terminal_size=SIZE, run_before=run_before)


def test_lineages_tab_with_a_checkpoint_timeline(snap_compare) -> None:
    """The entry table sorted by last use, and the selected entry's checkpoints on its token axis."""
    assert snap_compare(recorded_app(), terminal_size=SIZE, run_before=after("2", "down"))


def test_anchors_tab_evict_dialog(snap_compare) -> None:
    """The confirmation says what an eviction frees before anything happens."""
    assert snap_compare(recorded_app(), terminal_size=SIZE, run_before=after("3", "x"))


def test_lineages_filtered(snap_compare) -> None:
    """``/`` filters the table as you type; the title says how many rows match."""
    assert snap_compare(recorded_app(), terminal_size=SIZE, run_before=after("2", "slash", "a", "n", "c"))


def test_read_only_mode_hides_the_verbs(snap_compare) -> None:
    """No pin/unpin/evict in the footer, a READ-ONLY badge in the header."""
    assert snap_compare(recorded_app(read_only=True), terminal_size=SIZE, run_before=after("2"))


def test_restart_tab_waiting_for_requests_in_flight(snap_compare) -> None:
    """The roll, held while it waits for two requests in flight."""
    restarter = ScriptedRestarter(servers=("main", "backup"), hold_at=2)

    async def run_before(pilot) -> None:
        restarter.abandon = pilot.app.closing  # the screenshot closes the app while the roll is held
        await after("4")(pilot)
        await pilot.press("R")
        await pilot.pause()
        await pilot.press("y")
        await wait_for(pilot, restarter.held.is_set)
        pane = pilot.app.query_one("#pane-restart")
        await wait_for(pilot, lambda: bool(pane.steps) and pane.steps[-1].phase == "waiting")
        await pilot.pause()

    assert snap_compare(recorded_app(restarter=restarter), terminal_size=SIZE, run_before=run_before)


def test_help_screen(snap_compare) -> None:
    assert snap_compare(recorded_app(), terminal_size=SIZE, run_before=after("question_mark"))


def test_live_tab_at_80x24(snap_compare) -> None:
    """The smallest terminal: budgets in two columns, the graphs side by side, request rows, no counters."""
    assert snap_compare(recorded_app(), terminal_size=(80, 24), run_before=after())


def test_live_tab_at_120x40(snap_compare) -> None:
    """The first wide layout: budgets beside the stacked graphs, counters and cache events below."""
    assert snap_compare(recorded_app(), terminal_size=(120, 40), run_before=after())


def test_live_graphs_over_a_minute_at_120x40(snap_compare) -> None:
    """``t``: the graphs over the last minute of wall-clock time; idle seconds are blank."""
    assert snap_compare(recorded_app(), terminal_size=(120, 40), run_before=after("t"))


def test_log_tab_at_80x24(snap_compare) -> None:
    """Every streamed event as a line, in time order, the newest at the bottom."""
    assert snap_compare(recorded_app(), terminal_size=(80, 24), run_before=after("5"))


def test_fleet_tab(snap_compare) -> None:
    """apcctl fleet top: three servers (healthy, draining mid-roll, absent) and where the requests went."""
    source = RecordedSource.load(RECORDING)
    app = make_app(source, fleet=StaticFleetSource(recorded_fleet(source.recording)))
    assert snap_compare(app, terminal_size=SIZE, run_before=after("6"))
