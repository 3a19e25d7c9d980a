"""Budgets that bound, on a real server under parallel load (tiny model, real disk files).

* RAM: ``APC_LINEAGE_RAM_BUDGET_BYTES`` at a few hundred KB and 8 conversations in parallel.
  A sampler polling ``/admin/status`` never sees ``ram_used`` (entries in RAM plus what the
  disk writer still holds of entries that left RAM) above the limit, entries really were
  evicted, and every answer equals a cold prefill's.
* Disk: the disk cap is below what RAM holds. Once the idle write-behind has written what RAM
  holds, idle ticks write nothing more (deleting a file for the cap does not make its entry
  dirty again, so no tick rewrites it only to delete another file).
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from tests.server_harness import PatchedServer, assert_same_output, reply_text, text
from tests.e2e.test_e2e_conversation import _run_concurrently

RAM_BUDGET = 600_000  # a conversation entry here weighs 60-400 KB (adopted buffers keep spare rows)
DISK_CAP = 250_000
PARAMS = {"max_tokens": 4, "logprobs": True, "top_logprobs": 5}
CONVERSATIONS, TURNS = 8, 3
TICK_S = 0.5  # the idle ticker's period at APC_LINEAGE_DISK_WRITE_DELAY_S below 2 s


class StatusSampler(threading.Thread):
    """Polls ``/admin/status`` until stopped; keeps every ``lineage.budgets`` it saw."""

    def __init__(self, server: PatchedServer) -> None:
        super().__init__(daemon=True)
        self.server = server
        self.seen: list[dict[str, int]] = []
        self.errors: list[Any] = []
        self._stop_event = threading.Event()

    def run(self) -> None:
        while not self._stop_event.is_set():
            status, body = self.server.admin("GET", "/status")
            if status != 200:
                self.errors.append((status, body))
            elif body["lineage"] is not None:  # None until the first request creates the cache
                self.seen.append(body["lineage"]["budgets"])
            time.sleep(0.005)

    def stop(self) -> None:
        self._stop_event.set()
        self.join(30)


def _stats(server: PatchedServer) -> dict[str, int]:
    status, body = server.admin("GET", "/status")
    assert status == 200, body
    return {**body["lineage"]["stats"], "disk_pending_writes": body["lineage"]["disk_pending_writes"]}


def _wait_quiet(server: PatchedServer, timeout: float = 60.0) -> dict[str, int]:
    """The stats once no write is pending and three tick periods passed without a write (the
    timeout only bounds a server that keeps writing: the fault this file tests)."""
    deadline = time.monotonic() + timeout
    last, quiet_since = _stats(server), time.monotonic()
    while time.monotonic() - quiet_since < 3 * TICK_S:
        assert time.monotonic() < deadline, f"idle ticks kept writing: {last}"
        time.sleep(TICK_S / 5)
        now = _stats(server)
        if now.get("disk_writes", 0) != last.get("disk_writes", 0) or now["disk_pending_writes"]:
            quiet_since = time.monotonic()
        last = now
    return last


def _conversation(i: int) -> list[dict[str, str]]:
    return [{"role": "system", "content": text(60, 500 + i)}, {"role": "user", "content": text(40, 600 + i)}]


@pytest.mark.server
def test_ram_budget_bounds_everything_held_under_parallel_load_and_idle_ticks_settle(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    env = {"TOP_LOGPROBS_K": "5", "APC_LINEAGE_DISK": "1",
           "APC_LINEAGE_RAM_BUDGET_BYTES": str(RAM_BUDGET), "APC_LINEAGE_DISK_MAX_BYTES": str(DISK_CAP),
           "APC_LINEAGE_DISK_WRITE_DELAY_S": "0.2"}
    with PatchedServer(tiny_model_dir, env=env, log_dir=tmp_path) as server:
        convs = [_conversation(i) for i in range(CONVERSATIONS)]
        asked: list[tuple[list[dict[str, str]], dict]] = []
        sampler = StatusSampler(server)
        sampler.start()
        try:
            for turn in range(TURNS):
                answers = _run_concurrently([(lambda c=c: server.chat(c, tenant="budget", **PARAMS))
                                             for c in convs])
                asked += [(list(c), a) for c, a in zip(convs, answers)]
                convs = [c + [{"role": "assistant", "content": reply_text(a)},
                              {"role": "user", "content": text(20, 700 + 10 * turn + i)}]
                         for i, (c, a) in enumerate(zip(convs, answers))]
        finally:
            sampler.stop()
        assert not sampler.errors, sampler.errors[:3]
        assert len(sampler.seen) > 10, "the sampler did not run during the load"
        worst = max(sampler.seen, key=lambda b: b["ram_used"])
        assert worst["ram_limit"] == RAM_BUDGET
        over = [b["ram_used"] for b in sampler.seen if b["ram_used"] > RAM_BUDGET]
        assert worst["ram_used"] <= RAM_BUDGET, (sorted(worst.items()), over)
        stats = _stats(server)
        assert stats.get("evictions", 0) > 0, stats  # the budget really was exercised
        assert stats.get("reused_tokens", 0) > 0, stats  # and the cache still served warm turns

        # Idle: the write-behind's first pass writes what RAM holds, the cap deletes files
        # (it is below RAM); after that, ticks with no traffic write nothing.
        settled = _wait_quiet(server)
        assert settled.get("disk_evictions", 0) > 0, settled  # the cap is really below RAM
        time.sleep(6 * TICK_S)
        later = _stats(server)
        assert later.get("disk_writes", 0) == settled.get("disk_writes", 0), (settled, later)
        assert later["disk_pending_writes"] == 0

        # Every answer equals a cold prefill's (a fresh tenant shares nothing).
        for n, (messages, warm) in enumerate(asked):
            assert_same_output(warm, server.chat(messages, tenant=f"cold-{n}", **PARAMS))
