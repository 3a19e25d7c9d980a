"""A commit never waits for the disk writer (issue 29): the RAM budget is kept at once.

The commit runs on mlx-vlm's one generation thread, so any wait there is a wait for every
decoding stream. Under a full budget with a writer that never lands, commits and promotions
return without waiting or sleeping, the budget holds, the least recently used entry without
room in the writer's queue leaves RAM unwritten (counted), and what the cache did on that
path is metadata only: the disk tier was asked to queue writes, never to read, write or
delete a file, and the state handles were asked for their sizes only.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import numpy as np
import pytest

from server_patch.lineage import DiskRecord, Entry, LineageCache, LineageConfig, SizedKV, SizedSnapshot
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)
from tests.lineage.test_lineage_policy import ENTRY_BYTES, KV_PER_TOKEN, SNAP, Clock

pytestmark = pytest.mark.usefixtures("checked_lineage")


class DataTouched(AssertionError):
    """The commit path reached for state data or a file: more than metadata."""


class MetadataKV(SizedKV):
    """KV rows that answer their sizes and nothing else."""

    def prefix(self, length: int) -> "SizedKV":
        raise DataTouched(f"prefix({length}): a copy of KV rows on the commit path")

    def truncated(self, length: int) -> "SizedKV":
        raise DataTouched(f"truncated({length}) on the commit path")


class StalledWriter:
    """A disk tier whose writer never lands (a stalled disk): ``write`` only queues, as
    ``DiskStore.write`` does (its thread does the file work). Anything else raises."""

    writes_in_background = True  # as DiskStore: the policy must not expect a write to land

    def __init__(self) -> None:
        self.queued: list[tuple[Entry, Callable[[Entry, DiskRecord | None], None]]] = []
        self.lands = threading.Event()  # never set while the commits run

    def records(self) -> list[DiskRecord]:
        return []

    def write(self, entry: Entry, done: Callable[[Entry, DiskRecord | None], None]) -> None:
        self.queued.append((entry, done))

    def delete(self, record_id: str) -> None:
        raise DataTouched(f"a file delete ({record_id}) on the commit path")

    def land(self) -> None:
        """The writer catches up (after the commits): every queued file is written."""
        self.lands.set()
        while self.queued:
            entry, done = self.queued.pop(0)
            done(entry, DiskRecord(entry.id, entry.tokens, entry.namespace,
                                   tuple((c.length, c.kind) for c in entry.checkpoints),
                                   entry.nbytes, 0.0, entry.is_anchor, entry.pinned))


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.RandomState(seed).randint(10, 30000, n).astype(np.int32)


def _commit(cache: LineageCache, seed: int) -> Entry | None:
    prompt = _prompt(300, seed)
    end = len(prompt) - cache.config.entry_offset
    return cache.commit(prompt, kv=MetadataKV(KV_PER_TOKEN, end), head=SizedSnapshot(SNAP))


@pytest.fixture
def no_waiting(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every way a thread could wait for another raises (a test of this file's own thread)."""
    me = threading.get_ident()

    def refuse(name: str, real: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == me:
                raise AssertionError(f"{name} on the commit path")
            return real(*args, **kwargs)
        return guarded

    monkeypatch.setattr(threading.Condition, "wait", refuse("Condition.wait", threading.Condition.wait))
    monkeypatch.setattr(threading.Condition, "wait_for",
                        refuse("Condition.wait_for", threading.Condition.wait_for))
    monkeypatch.setattr(threading.Event, "wait", refuse("Event.wait", threading.Event.wait))
    monkeypatch.setattr(time, "sleep", refuse("time.sleep", time.sleep))


def _cache(disk: StalledWriter) -> LineageCache:
    return LineageCache(LineageConfig(ram_budget_bytes=int(2.5 * ENTRY_BYTES), periodic_stride=0,
                                      guard_min_suffix=10_000), disk=disk, clock=Clock())


def test_commits_under_a_full_budget_drop_the_least_recently_used_unwritten_entry(no_waiting: None) -> None:
    disk = StalledWriter()
    cache = _cache(disk)
    stored = [_commit(cache, 10 + i) for i in range(6)]
    budget = cache.config.ram_budget_bytes
    assert cache.ram_used <= budget, cache.budgets()
    # Each commit past the second pushed out the least recently used entry; with nothing on
    # disk and no room in the writer's queue, it left RAM unwritten, counted.
    assert [cache.holds(e) for e in stored] == [False] * 4 + [True] * 2
    assert cache.stats["evicted_unwritten"] == cache.stats["evictions"] == 4
    assert disk.queued == []


def test_a_stalled_writer_holding_the_budget_drops_the_new_entry_at_once(no_waiting: None) -> None:
    disk = StalledWriter()
    cache = _cache(disk)
    held = [_commit(cache, 20 + i) for i in range(2)]
    assert cache.flush() == 2  # the writer takes both, and stalls: their arrays stay held
    newest = _commit(cache, 22)
    assert not disk.lands.is_set()  # the writer never landed: the commit did not wait for it
    assert newest is None  # no room: the entries the writer holds cannot free anything now
    assert all(cache.holds(e) for e in held)
    assert cache.ram_used <= cache.config.ram_budget_bytes
    assert cache.stats["evicted_unwritten"] == 1 and [e.id for e, _ in disk.queued] == [e.id for e in held]
    disk.land()  # the writer catches up: the next commit evicts a written entry, losing nothing
    after = _commit(cache, 23)
    assert after is not None and cache.holds(after) and cache.stats["evicted_unwritten"] == 1
    assert not cache.holds(held[0]) and cache.lookup(_prompt(300, 20)).tier == "disk"
    assert cache.ram_used <= cache.config.ram_budget_bytes


def test_a_promotion_with_a_stalled_writer_never_waits_and_keeps_the_budget(no_waiting: None) -> None:
    disk = StalledWriter()
    cache = _cache(disk)
    for i in range(3):
        _commit(cache, 30 + i)
    tokens = _prompt(300, 39)[:299]
    record = DiskRecord("ondisk", tokens, "", (), ENTRY_BYTES, 0.0)
    loaded = Entry(id="ondisk", tokens=tokens, kv=MetadataKV(KV_PER_TOKEN, 299), head=SizedSnapshot(SNAP),
                   namespace="", created=0.0, last_used=0.0)
    assert cache.promote(record, loaded) is loaded
    assert cache.ram_used <= cache.config.ram_budget_bytes and cache.holds(loaded)
