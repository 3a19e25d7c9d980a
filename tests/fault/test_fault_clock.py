"""A wall clock stepped back an hour under a real server (test fault ``APC_TEST_FAULT_CLOCK_STEP_FILE``).

Before the fix the write-behind, the LRU order and the canary's idle test read the wall clock:
stepped back an hour, entries stayed RAM-only for an hour and the canary found the server busy.
Now intervals read a monotonic clock, and only what is shown (request times, event times) moves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.server_harness import PatchedServer, text, wait_for

REPO = Path(__file__).resolve().parents[2]
HOUR = 3600.0


def _conversations(server: PatchedServer) -> list[dict]:
    status, body = server.admin("GET", "/entries?kind=conversation")
    assert status == 200, body
    return body["entries"]


@pytest.mark.server
def test_a_clock_stepped_back_an_hour_delays_neither_write_behind_nor_the_canary(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    step = tmp_path / "clock-step"
    step.write_text("0")
    env = {"APC_LINEAGE_DISK": "1", "APC_LINEAGE_DISK_PATH": str(tmp_path / "disk"),
           "APC_LINEAGE_DISK_WRITE_DELAY_S": "1", "APC_CANARY_IDLE_S": "1",
           "APC_TEST_FAULTS": "1", "APC_TEST_FAULT_CLOCK_STEP_FILE": str(step)}
    server = PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path / "log")
    try:
        server.start()
        server.chat([{"role": "user", "content": text(200, 601)}], max_tokens=2)
        step.write_text(str(-HOUR))  # the wall clock jumps back an hour
        server.chat([{"role": "user", "content": text(200, 602)}], max_tokens=2)
        status, requests = server.admin("GET", "/requests")
        assert status == 200, requests
        first, second = (r["started"] for r in requests["requests"][-2:])
        assert second < first - HOUR / 2, (first, second)  # the server did see the step
        # Both conversations reach the disk after the write-behind delay, not an hour later.
        wait_for(lambda: [e["tier"] for e in _conversations(server)] == ["ram+disk", "ram+disk"],
                 "the write-behind of both conversations", server)
        status, verified = server.admin("POST", "/verify", {"timeout_s": 120})
        assert status == 200 and verified["complete"] and verified["fail"] == 0, verified
    finally:
        server.stop()


def test_only_the_clock_module_reads_the_wall_clock() -> None:
    """Every wall-clock read goes through ``server_patch.clock.wall`` (stepped by the fault
    above); the lineage policy's injectable default is the one other mention (the runtime
    passes ``clock.steady``)."""
    allowed = {REPO / "server_patch" / "clock.py", REPO / "server_patch" / "lineage" / "policy.py"}
    found = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "server_patch").rglob("*.py"))
             if path not in allowed
             for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"\btime\.time\b", line)]
    assert not found, found
