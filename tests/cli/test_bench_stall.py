"""``apcctl bench stall --quick`` on the tiny model: every scenario, stock and patched, and what
each row says (the gaps of the same stream alone and with the event, the event's duration, the
restores and evictions the event really caused). Real servers; never a time threshold.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from apcctl.bench import stall
from apcctl.cli import main

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def result(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict:
    workdir = tmp_path_factory.mktemp("stall")
    out = CliRunner().invoke(main, ["bench", "stall", "--quick", "--model", str(tiny_model_dir), "--json",
                                    "--workdir", str(workdir), "--tokens", "12", "--context", "300"])
    assert out.exit_code == 0, out.output
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_every_scenario_runs_on_both_servers_with_the_gaps_of_the_same_stream(result: dict) -> None:
    rows = {(r["scenario"], r["mode"]): r for r in result["rows"]}
    assert set(rows) == {(s, m) for s in stall.SCENARIOS for m in stall.MODES}
    for row in rows.values():
        for gaps in (row["alone"], row["with_event"]):
            assert gaps["tokens"] >= 2
            assert gaps["p50"] <= gaps["p99"] <= gaps["max"]
        assert row["event_ms"] > 0
        assert row["max_vs_alone"] == round(row["with_event"]["max"] / row["alone"]["max"], 1)
    for mode in stall.MODES:  # the prefill rate of the events that computed tokens
        assert rows[("cold-prefill", mode)]["event_prefill_tps"] > 0


def test_the_events_did_what_their_names_say(result: dict) -> None:
    rows = {(r["scenario"], r["mode"]): r for r in result["rows"]}
    assert rows[("cold-prefill", "patched")]["event_cached_tokens"] == 0
    for mode in stall.MODES:  # the next turn restored its conversation (RAM, then disk)
        assert rows[("ram-restore", mode)]["event_cached_tokens"] > 0
        assert rows[("disk-restore", mode)]["event_cached_tokens"] > 0
    for mode in ("patched", "patched-unpaced"):
        budget = rows[("full-budget", mode)]["event_stats"]
        assert budget["evictions"] > 0, budget  # the commits really pushed entries out of a full budget
    assert result["budget_bytes"] > 0


def test_the_table_has_a_row_per_scenario_and_mode(result: dict) -> None:
    table = stall.render(result).splitlines()
    assert len(table) == 2 + len(result["rows"]) + 1
    assert all(any(line.startswith(s) for line in table) for s in stall.SCENARIOS)
