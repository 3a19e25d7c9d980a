"""``apcctl demo``: one command builds the tiny model, serves it, drives traffic, and cleans up."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.cli.test_cli_server import run

pytestmark = pytest.mark.server


def test_demo_without_dashboard_prints_live_lines_and_stops_the_server(cli_env: Path) -> None:
    result = run("demo", "--no-dashboard", "--requests", "10", "--json")
    summary = json.loads(result.stdout)
    assert summary["sent"] == 10 and summary["failed"] == 0
    hits = summary["hits"]
    assert hits["requests"] >= 10 and hits["by_kind"].get("anchor", 0) >= 1  # shared system prompts hit
    assert hits["by_kind"].get("cold", 0) < hits["requests"]
    lines = result.stderr.splitlines()
    assert any(line.split()[:1] == ["1"] for line in lines)  # request seq 1 was printed live
    assert any(line.startswith("demo: traffic done: 10 requests sent (0 failed)") for line in lines)
    assert not any("reusing the disk tier" in line for line in lines)  # the first demo of this state dir
    assert any(" cache " in line and "pin" in line for line in lines)
    state = cli_env / "state" / "demo"
    assert (state / "model" / "config.json").exists()
    assert not (state / "server.pid").exists()
    assert not any("server_patch.launch" in " ".join(p.info["cmdline"] or []) and str(state) in
                   " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))


def test_demo_opens_the_dashboard_when_there_is_one(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    def run_dashboard(client: Any, *, read_only: bool = False, restart_targets: Any = None,
                      notices: Any = None) -> None:
        seen["notices"] = notices
        seen.update(url=client.base_url, token=client.token, status=client.status(),
                    targets=restart_targets, read_only=read_only)

    fake = types.ModuleType("tui.app")
    fake.run_dashboard = run_dashboard  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tui.app", fake)
    result = run("demo", "--requests", "3", "--json")
    assert seen["url"] == json.loads(result.stdout)["url"]
    assert seen["token"] and seen["status"]["server"]["model"].endswith("model")
    assert not seen["read_only"] and [t.url for t in seen["targets"]] == [seen["url"]]
    assert re.match(r"demo: traffic done: [0-3] requests sent", seen["notices"]())  # the dashboard is told (36.17)
    assert "demo: reusing the disk tier an earlier demo left" in result.stderr  # the first test's demo wrote it


def test_a_restart_in_the_dashboard_is_said_in_the_summary(cli_env: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The dashboard's Restart tab rolls the demo's server: the summary's counters are the new
    process's, and it says so instead of mixing two processes' numbers into one hit rate."""
    from apcctl.core.roll import restart_targets as roll

    def run_dashboard(client: Any, *, read_only: bool = False, restart_targets: Any = None,
                      notices: Any = None) -> None:
        done = roll(restart_targets, on_progress=lambda step: None, timeout=120)  # what R in the Restart tab runs
        assert done.ok, done.as_dict()

    fake = types.ModuleType("tui.app")
    fake.run_dashboard = run_dashboard  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "tui.app", fake)
    result = run("demo", "--requests", "3")
    # The traffic stops when the dashboard closes, so how many of the 3 were sent depends on timing.
    line = next(line for line in result.stdout.splitlines() if re.match(r"demo: [0-3] requests", line))
    assert "the server restarted (pid " in line and "so its counters cover the" in line
