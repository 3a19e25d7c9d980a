"""The dashboard's pure parts: state (dedupe across reconnects and restarts), dialog texts, filters, the axis."""

from __future__ import annotations

import inspect
import io
import json

import pytest
from click.testing import CliRunner
from rich.color import Color
from rich.console import Console

from apcctl.cli import main
from apcctl.core.client import AdminClient
from apcctl.core.process import ProcessInfo
from tui import impact, series
from tui.columns import LOST_SHORT, lost_cell, lost_total, oracle_cell, oracle_line, wait_cell
from tui.app import run_dashboard
from tui.source import Snapshot
from tui.state import DashboardState, hit_ratio, percentile
from tui.widgets.gauge import gauge_text
from tui.widgets.header import Mode, header_text
from tui.widgets.keyed_table import matches
from tui.widgets.spark import Bars
from tui.widgets.timeline import axis, column_of


def status(pid: int, started: float) -> dict:
    return {"server": {"pid": pid, "started": started}, "idle": {}, "pool": {}, "lineage": None}


def request(seq: int, restored: int = 0) -> dict:
    return {"seq": seq, "prompt_tokens": 100, "restored_tokens": restored, "ttft_ms": float(seq)}


def test_a_reconnect_replays_the_ring_and_nothing_is_counted_twice() -> None:
    state = DashboardState()
    state.apply_event("hello", {"pid": 1, "started": 10.0})
    assert [state.apply_event("request", request(n)) for n in (1, 2)] == ["request", "request"]
    state.apply_event("hello", {"pid": 1, "started": 10.0})  # same process: the stream reconnected
    assert [state.apply_event("request", request(n)) for n in (1, 2, 3)] == [None, None, "request"]
    assert [r.key for r in state.requests] == ["1:1", "1:2", "1:3"]
    assert state.restarts_seen == 0


def test_a_restarted_server_starts_its_sequence_again_and_keeps_the_old_rows() -> None:
    state = DashboardState()
    state.apply_snapshot(Snapshot(status(1, 10.0), [], None, 11.0))
    for n in (1, 2):
        state.apply_event("request", request(n))
    state.apply_event("hello", {"pid": 2, "started": 20.0})
    assert state.apply_event("request", request(1)) == "request"
    assert [r.key for r in state.requests] == ["1:1", "1:2", "2:1"]
    assert state.restarts_seen == 1
    state.apply_snapshot(Snapshot(status(2, 20.0), [], None, 21.0))  # the poll agrees: no second reset
    assert state.apply_event("request", request(1)) is None


def test_lost_and_back_counts_one_reconnect() -> None:
    state = DashboardState()
    state.poll_failed("refused")
    assert state.connection.state == "connecting"  # never reached yet
    state.apply_snapshot(Snapshot(status(1, 10.0), [], None, 11.0))
    state.poll_failed("refused")
    state.poll_failed("refused")
    assert (state.connection.state, state.connection.failures) == ("lost", 2)
    state.apply_snapshot(Snapshot(status(1, 10.0), [], None, 12.0))
    assert (state.connection.state, state.connection.reconnects, state.connection.failures) == ("live", 1, 0)


def test_request_metrics() -> None:
    assert hit_ratio([request(1, 0), request(2, 50), request(3, 99), request(4, 0)]) == 0.5
    assert hit_ratio([]) is None
    assert percentile([5, 1, 3, 2, 4], 50) == 3
    assert percentile([5, 1, 3, 2, 4], 95) == 5
    assert percentile([], 50) is None



def test_the_lost_column_names_the_top_reason_and_tolerates_an_older_server() -> None:
    from server_patch.lineage.misses import Lost

    assert set(LOST_SHORT) == {str(reason) for reason in Lost}  # every reason has its short name
    older = request(1, 50)  # a server before issue 26: no oracle, no lost
    assert (oracle_cell(older), str(lost_cell(older)), lost_total(older)) == ("-", "-", None)
    whole = {**request(2, 99), "oracle": 96, "lost": {}}
    assert (oracle_cell(whole), str(lost_cell(whole)), lost_total(whole)) == ("96", "", 0)
    two = {**request(3, 16), "oracle": 1296, "lost": {"no restore point": 80, "ram budget": 1200}}
    assert (oracle_cell(two), str(lost_cell(two)), lost_total(two)) == ("1,296", "ram 1,200+", 1280)
    newer = {**request(4, 0), "oracle": 32, "lost": {"a reason not yet known": 32}}
    assert str(lost_cell(newer)) == "a reason not yet known 32"


def test_the_wait_column_names_the_main_work_and_tolerates_an_older_server() -> None:
    from server_patch.integration.waits import Work

    assert str(wait_cell(request(1))) == "-"  # a server before issue 29's waits
    assert str(wait_cell({**request(2), "waited_ms": 0.0, "waited": {}})) == ""
    one = {**request(3), "waited_ms": 812.4, "waited": {Work.PREFILL: 812.4}}
    assert str(wait_cell(one)) == "812 prefill"
    two = {**request(4), "waited_ms": 2914.4, "waited": {"restore": 1.0, "prefill": 2908.0, "commit": 5.4}}
    assert str(wait_cell(two)) == "2,914 prefill+"


def test_a_request_ended_event_brings_its_kept_record_up_to_date() -> None:
    state = DashboardState()
    state.apply_event("hello", {"pid": 1, "started": 10.0})
    for n in (1, 2):
        state.apply_event("request", {**request(n), "waited_ms": 1.0, "waited": {"commit": 1.0}, "ended": False})
    final = {**request(1), "waited_ms": 501.0, "waited": {"commit": 1.0, "prefill": 500.0}, "ended": True}
    assert state.apply_event("request_ended", final) == "request"
    assert state.requests[0].data["waited_ms"] == 501.0 and state.requests[0].key == "1:1"
    assert state.apply_event("request_ended", final) is None  # a reconnect replays it: nothing changed
    assert state.apply_event("request_ended", {**request(9), "ended": True}) is None  # not kept
    assert len(state.requests) == 2 and state.logged == 2  # no new row, no new log line


def test_the_counters_oracle_line_is_one_line_largest_loss_first() -> None:
    totals = {"enabled": True, "requests": 9, "oracle_tokens": 1000, "restored_tokens": 670,
              "lost_tokens": {"thinning": 5, "ram budget": 160, "disk rejected": 70, "loan": 0}}
    line = oracle_line(totals)
    assert line.plain == "0.67 of unbounded · lost ram 16%, disk bad 7%, thinned <1%"
    assert line.no_wrap and line.overflow == "ellipsis"  # clipped to its box, never a second line
    assert oracle_line({"enabled": False}).plain.startswith("off")
    assert oracle_line({"enabled": True, "requests": 3, "oracle_tokens": 0}).plain == "no repeated prefix yet (3 requests)"


BUDGETS = {"ram_used": 1000, "ram_limit": 10_000, "conversation_bytes": 800, "anchor_bytes": 200,
           "anchor_bytes_limit": 1000, "anchor_count": 2, "anchor_count_limit": 2}


def entry(**fields) -> dict:
    return {"id": "e1", "kind": "conversation", "pinned": False, "length": 300, "bytes": 400, "disk_bytes": 500,
            "tier": "ram+disk", "checkpoints": [{"length": 100, "kind": "final"}], **fields}


def test_pin_says_what_it_holds_and_warns_over_a_cap() -> None:
    said = impact.pin(entry(), BUDGETS)
    assert said.possible
    assert "Holds 400 B of RAM on the anchor budget: 200 B -> 600 B of 1000 B; anchors in RAM 2 -> 3 of 2" in said.body
    assert "Over an anchor cap" in said.body
    assert not impact.pin(entry(tier="disk"), BUDGETS).possible
    assert not impact.pin(entry(pinned=True, kind="anchor"), BUDGETS).possible


def test_evict_says_what_it_frees() -> None:
    said = impact.evict(entry(), BUDGETS)
    assert "Frees 400 B of RAM (1000 B -> 600 B of 9.8 KiB) and 500 B of disk." in said.body
    assert "anchor slot" not in said.body
    assert "Frees an anchor slot in RAM (2 -> 1 of 2)" in impact.evict(entry(pinned=True, kind="anchor"), BUDGETS).body


def test_unpin_moves_the_bytes_between_budgets() -> None:
    said = impact.unpin(entry(pinned=True, kind="anchor"), BUDGETS)
    assert "Frees 400 B of the anchor budget" in said.body and "800 B -> 1.2 KiB" in said.body
    assert not impact.unpin(entry(), BUDGETS).possible


def test_anchor_files_are_text_or_json() -> None:
    assert impact.read_anchor_file("You are terse.\n") == ("You are terse.\n", None)
    tools = [{"type": "function", "function": {"name": "grep"}}]
    assert impact.read_anchor_file(json.dumps({"system": "S", "tools": tools})) == ("S", tools)
    assert impact.read_anchor_file("{not json") == ("{not json", None)
    said = impact.new_anchor("p.json", "x" * 400, tools, BUDGETS, [entry(pinned=True, kind="anchor")])
    assert "400 characters, 1 tool)" in said.body and "anchors 2 -> 3 of 2" not in said.body
    assert "(2 -> 3 of 2)" in said.body and "Over the anchor count cap" in said.body


def test_filter_is_a_substring_and_bang_inverts() -> None:
    assert matches("abc anchor ram", "ANCH")
    assert not matches("abc conversation", "anch")
    assert matches("abc conversation", "!anch")
    assert matches("anything", "  ")


def test_checkpoints_land_on_their_token_positions() -> None:
    assert [column_of(p, 100, 11) for p in (0, 50, 100)] == [0, 5, 10]
    line, labels = axis({"length": 400, "checkpoints": [{"length": 100, "kind": "final"},
                                                        {"length": 300, "kind": "guard"}]}, 60)
    assert line.plain.startswith("0 ├") and line.plain.endswith("▶┤ 400")
    assert "◆" in line.plain and "◇" in line.plain
    assert labels.plain.split() == ["100", "300"]


def test_gauge_turns_red_past_ninety_percent() -> None:
    text = gauge_text("disk", 95, 100, 40, unit="count")
    assert text.plain.endswith("95 / 100")
    assert any(span.style == "red" for span in text.spans)


def test_run_dashboard_signature_is_the_one_the_demo_calls() -> None:
    params = inspect.signature(run_dashboard).parameters
    assert list(params) == ["client", "read_only", "restart_targets", "refresh_s", "fleet", "notices"]
    assert params["notices"].kind is inspect.Parameter.KEYWORD_ONLY and params["notices"].default is None
    assert params["fleet"].kind is inspect.Parameter.KEYWORD_ONLY and params["fleet"].default is None
    assert params["refresh_s"].kind is inspect.Parameter.KEYWORD_ONLY and params["refresh_s"].default == 1.0
    assert params["client"].annotation in (AdminClient, "AdminClient")
    assert params["read_only"].kind is inspect.Parameter.KEYWORD_ONLY and params["read_only"].default is False
    assert params["restart_targets"].default is None


def bars(values, width=6, height=2, ceiling=1.0) -> list[str]:
    """The lines a sparkline draws, top first."""
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(Bars(values, width, height, ceiling, Color.parse("red"), Color.parse("green")), end="")
    return console.export_text().split("\n")


def test_a_zero_hit_ratio_draws_the_lowest_mark_not_full_bars() -> None:
    assert bars([0.0]) == ["      ", "     ▁"]  # one value, newest at the right; Textual's drew it full
    assert bars([0.0, 0.5, 1.0]) == ["     █", "   ▁██"]
    assert bars([None, 0.25, None]) == ["      ", "    ▄ "]  # None: nothing happened then
    assert bars([0.8, 0.9, 1.0], ceiling=None, height=1, width=3) == ["▆▇█"]  # scaled to the largest, from 0
    assert bars(list(range(10)), width=4, height=1, ceiling=9) == ["▅▆▇█"]  # the newest that fit


def test_graphs_over_time_slice_the_window_and_leave_idle_slices_blank() -> None:
    records = [{"started": t, "prompt_tokens": 100, "restored_tokens": r, "ttft_ms": float(t)}
               for t, r in ((100.0, 0), (101.0, 100), (159.0, 50), (30.0, 100))]
    now, window = 160.0, 60.0
    hits = series.over_time(records, series.reuse, 6, now, window, series.mean)
    assert hits == [0.5, None, None, None, None, 0.5]  # 30.0 is outside the window
    assert series.over_time(records, series.ttft, 6, now, window, max) == [101.0, None, None, None, None, 159.0]
    assert series.per_request(records, series.ttft, 2) == [159.0, 30.0]
    assert series.series(records, series.ttft, series.AXES[0], now, max)(3) == [101.0, 159.0, 30.0]
    assert [a.window_s for a in series.AXES] == [None, 60.0, 600.0, 3600.0]


def test_the_header_fits_eighty_columns_and_keeps_the_badges() -> None:
    state = DashboardState()
    state.apply_snapshot(Snapshot({"server": {"pid": 4242, "started": 1.0, "uptime_s": 3600, "model": "/m/tiny",
                                              "mlx_vlm_version": "0.7.10", "patch_version": "0.1.0"},
                                   "idle": {"in_flight": 2, "queued": 1, "draining": True}, "lineage": None},
                                  [], ProcessInfo(4242, 1 << 30, 12.0), 2.0))
    wide = header_text(state, "http://127.0.0.1:8080", Mode(read_only=True), width=None).plain.split("\n")
    assert "mlx-vlm 0.7.10" in wide[1] and "RSS 1.0 GiB" in wide[0]
    first, second = header_text(state, "http://127.0.0.1:8080", Mode(read_only=True), width=78).plain.split("\n")
    assert len(first) <= 78 and len(second) <= 78
    assert first.startswith("● live, events reconnecting  http://127.0.0.1:8080") and "model tiny" in first
    assert "DRAINING" in second and "READ-ONLY" in second and "in flight 2" in second
    assert "patch" not in second  # the versions go first


def test_the_header_names_restore_kinds_the_canary_found_suspect() -> None:
    state = DashboardState()
    status = {"server": {"pid": 1, "uptime_s": 5}, "idle": {}, "lineage": None,
              "canary": {"suspects": [], "on_fail": "cold"}}
    state.apply_snapshot(Snapshot(status, [], None, 1.0))
    assert "SUSPECT" not in header_text(state, "u", Mode(), width=100).plain
    state.apply_snapshot(Snapshot({**status, "canary": {"suspects": ["final"], "on_fail": "cold"}}, [], None, 2.0))
    assert "SUSPECT: final" in header_text(state, "u", Mode(), width=100).plain.split("\n")[1]


def test_a_narrow_gauge_drops_its_detail_before_its_bar() -> None:
    wide = gauge_text("RAM total    ", 5 << 20, 10 << 20, 60, detail="31 entries").plain
    narrow = gauge_text("RAM total    ", 5 << 20, 10 << 20, 36, detail="31 entries").plain
    assert wide.endswith("5.0 MiB / 10.0 MiB  31 entries") and len(wide) < 60
    assert narrow.endswith("5.0 MiB / 10.0 MiB") and "━━━━" in narrow and len(narrow) < 36


def test_top_refuses_a_zero_interval(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("APC_STATE_DIR", str(tmp_path / "state"))  # no config or state of the developer's
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "xdg"))
    for key in ("APCCTL_SERVER", "APCCTL_TOKEN", "APCCTL_CONFIG"):
        monkeypatch.delenv(key, raising=False)
    result = CliRunner().invoke(main, ["top", "--interval", "0"])
    assert result.exit_code == 2 and "--interval" in result.output and "0.1<=x<=3600" in result.output


def test_a_fleet_with_nothing_answering_is_a_source_error_and_a_quiet_server_reads_unreachable() -> None:
    from apcctl.core.hosts import free_port
    from tui.fleet import FleetServer, FleetSnapshot, LiveFleetSource
    from tui.panes.fleet import gateway_line
    from tui.source import SourceError

    dead = f"http://127.0.0.1:{free_port()}"
    source = LiveFleetSource(dead, "cache_aware", [("fleet-1", AdminClient(f"http://127.0.0.1:{free_port()}"))])
    with pytest.raises(SourceError, match="neither the gateway nor any server"):
        source.snapshot()
    quiet = FleetServer("fleet-1", dead, "absent", status=None, error="connection refused")
    assert quiet.hits["requests"] == 0 and quiet.budgets == {} and quiet.idle == {}
    sized = FleetServer("fleet-2", dead, "healthy", status={"sizing": {"budgets": {"ram_limit": 8}}})
    assert sized.budgets == {"ram_limit": 8}  # before the first request: the configured budgets
    line = gateway_line(FleetSnapshot(dead, "cache_aware", [quiet, sized], gateway_error="refused"), "")
    assert "1 of 2 servers healthy" in line.plain and "fleet-1 does not answer: connection refused" in line.plain
    assert "the gateway does not answer: refused" in line.plain
