"""A stalled disk writer never blocks a commit (issue 29), on a real server on the tiny model.

The writer is stalled inside its first write (``APC_TEST_FAULT_DISK_STALL_S``: it sleeps between
the temp file and the rename for longer than the test runs) and the RAM budget is a few
entries, so every later commit finds RAM full of state the disk lacks. Before issue 29 each
such commit waited on the generation thread for the writer (up to 10 s, counted as
``disk_write_waits_timed_out``); now it frees RAM at once. The test proves it from states, not
times: every answer came back while the writer was still inside that first write (its temp
file is there, no write landed), the least recently used entries left RAM unwritten and were
counted (status and Prometheus), the budget held at every sample, and the answers equal a
cold prefill's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server_harness import PatchedServer, assert_same_output, text, wait_for
from server_patch.disk import integrity
from tests.e2e.test_e2e_disk import _cold, _env, _send
from tests.fault.test_fault_budgets import StatusSampler

RAM_BUDGET = 400_000  # a few of the tiny model's conversation entries (60-400 KB each)
CONVERSATIONS = 8


@pytest.mark.server
def test_commits_under_a_full_budget_never_wait_for_a_stalled_writer(tiny_model_dir: Path, tmp_path: Path) -> None:
    disk = tmp_path / "lineage-disk"
    env = _env(disk, APC_TEST_FAULTS="1", APC_TEST_FAULT_DISK_STALL_S="600",
               APC_LINEAGE_RAM_BUDGET_BYTES=str(RAM_BUDGET), APC_LINEAGE_DISK_WRITE_DELAY_S="0.2")
    server = PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path)
    server.start()
    try:
        def temp_files() -> list[Path]:
            return [p for p in disk.rglob("*.safetensors") if integrity.is_temp(p)]

        first = [{"role": "system", "content": text(60, 1500)}, {"role": "user", "content": text(60, 1600)}]
        asked = [(first, _send(server, first)[0])]
        wait_for(lambda: bool(temp_files()), "the writer stalled inside its first write", server)
        sampler = StatusSampler(server)
        sampler.start()
        try:
            for i in range(1, CONVERSATIONS):
                messages = [{"role": "system", "content": text(60, 1500 + i)},
                            {"role": "user", "content": text(60, 1600 + i)}]
                asked.append((messages, _send(server, messages)[0]))
        finally:
            sampler.stop()
        # Every answer is back, and the writer is still inside its first write: no commit can
        # have waited for it to land.
        status, body = server.admin("GET", "/status")
        assert status == 200, body
        stats = body["lineage"]["stats"]
        assert temp_files() and stats.get("disk_writes", 0) == 0, stats
        assert body["lineage"]["disk_pending_writes"] >= 1
        assert "disk_write_waits_timed_out" not in stats, stats  # the old wait's counter
        # RAM was full of unwritten state: the least recently used entries left it unwritten.
        assert stats.get("evicted_unwritten", 0) >= 1, stats
        assert not sampler.errors, sampler.errors[:3]
        assert sampler.seen and max(b["ram_used"] for b in sampler.seen) <= RAM_BUDGET
        status, metrics = server.admin("GET", "/metrics")
        assert status == 200
        assert f"apc_lineage_evicted_unwritten_total {float(stats['evicted_unwritten'])}" in str(metrics)
        for messages, warm in asked[-2:]:  # the newest are still in RAM: warm equals cold
            assert_same_output(warm, _cold(server, messages))
    finally:
        server.stop(timeout=5)  # the stalled writer would hold a graceful close: SIGKILL after 5 s
