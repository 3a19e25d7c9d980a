"""A commit never waits for the disk writer (issue 29): the RAM budget is kept at once.

The commit runs on mlx-vlm's one generation thread, so any wait there is a wait for every
decoding stream. Under a full budget with a writer that never lands, commits and promotions
return without waiting or sleeping, the budget holds, the least recently used entry without
room in the writer's queue leaves RAM unwritten (counted), and what the cache did on that
path is metadata only: the disk tier was asked to queue writes, never to read, write or
delete a file, and the state handles were asked for their sizes only. With the real disk store
the same holds: its ``write`` reads no free space (``statvfs``) and opens no file on the
committing thread. And a shared row's reply commit into the room its prompt-end copy left
writes only its reply rows (the copy ledger), never the whole row, waiting for nothing.
"""

from __future__ import annotations

import builtins
import io
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from server_patch.observe import ledger
from server_patch.disk import store as disk_store
from server_patch.lineage import DiskRecord, Entry, LineageCache, LineageConfig, SizedKV, SizedSnapshot
from server_patch.state.layout import CacheLayout
from tests.copyfree.test_reply_append import per_token_kv_bytes
from tests.copyfree.test_reply_room import MAX_TOKENS, PROMPT, REPLY, cold_pair, decode_both
from tests.fake_model import random_tokens
from tests.integration.test_row_machine import server  # noqa: F401 (the fixture)
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


class CommitPath:
    """While ``armed``, every way this test's thread could wait for another thread or touch a
    file raises, and is recorded (``touched``: a caller that swallows the error still fails)."""

    def __init__(self) -> None:
        self.me = threading.get_ident()
        self.armed = True
        self.touched: list[str] = []

    def refuse(self, name: str, real: Any) -> Any:
        def guarded(*args: Any, **kwargs: Any) -> Any:
            if self.armed and threading.get_ident() == self.me:
                self.touched.append(name)
                raise AssertionError(f"{name} on the commit path")
            return real(*args, **kwargs)
        return guarded

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Armed for the block only (the test's own setup may wait and read files)."""
        self.armed = True
        try:
            yield
        finally:
            self.armed = False


@pytest.fixture
def commit_path(monkeypatch: pytest.MonkeyPatch) -> CommitPath:
    """Waits, sleeps, free-space reads and file I/O on this test's thread raise (armed at once)."""
    guard = CommitPath()
    for owner, name, label in ((threading.Condition, "wait", "Condition.wait"),
                               (threading.Condition, "wait_for", "Condition.wait_for"),
                               (threading.Event, "wait", "Event.wait"), (time, "sleep", "time.sleep"),
                               (os, "statvfs", "os.statvfs"), (os, "open", "os.open"), (os, "fsync", "os.fsync"),
                               (os, "replace", "os.replace"), (builtins, "open", "open"), (io, "open", "io.open")):
        monkeypatch.setattr(owner, name, guard.refuse(label, getattr(owner, name)))
    yield guard
    guard.armed = False
    assert guard.touched == [], guard.touched


@pytest.fixture
def no_waiting(commit_path: CommitPath) -> None:
    """Every way a thread could wait for another raises (a test of this file's own thread)."""


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


class StalledThread:
    """The disk writer thread, stalled: turns are queued and never run."""

    def __init__(self) -> None:
        self.turns: list[Any] = []

    def submit(self, job: Any) -> bool:
        self.turns.append(job)
        return True


def test_the_real_disk_stores_write_reads_no_free_space_and_opens_no_file_on_the_commit_path(
        tmp_path, commit_path: CommitPath) -> None:
    commit_path.armed = False
    writer = StalledThread()
    store = disk_store.DiskStore(tmp_path, fingerprint="fp", layout=CacheLayout([]), writer=writer)
    cache = LineageCache(LineageConfig(ram_budget_bytes=int(2.5 * ENTRY_BYTES), periodic_stride=0,
                                       guard_min_suffix=10_000), disk=store, clock=Clock())
    with commit_path.watching():
        held = [_commit(cache, 40 + i) for i in range(2)]
        assert cache.flush() == 2  # queued for the (stalled) writer, on this thread: no statvfs, no file
        newest = _commit(cache, 42)  # the budget is full of entries the writer holds
    assert store.pending == 2 and len(writer.turns) == 2 and cache.stats["disk_write_failures"] == 0
    assert newest is None and all(cache.holds(e) for e in held) and cache.stats["evicted_unwritten"] == 1
    assert cache.ram_used <= cache.config.ram_budget_bytes and list(tmp_path.glob("*.safetensors")) == []


def test_a_shared_rows_reply_commit_into_its_room_writes_only_the_reply_rows_and_waits_for_nothing(
        server, commit_path: CommitPath, monkeypatch: pytest.MonkeyPatch) -> None:

    commit_path.armed = False
    monkeypatch.setattr(ledger.LEDGER, "_on", True)
    ledger.reset()
    s = server
    prompts = [random_tokens(PROMPT, seed=121), random_tokens(PROMPT, seed=122)]
    batch = cold_pair(s, prompts)
    decode_both(s, batch, [random_tokens(REPLY, seed=123), random_tokens(REPLY, seed=124)])
    s.disk.land()
    (first,) = [e for e in s.cache.entries() if np.array_equal(e.tokens, prompts[0][:-1])]
    per_token = per_token_kv_bytes(first.kv)
    assert first.kv.capacity() > PROMPT + MAX_TOKENS[0]
    ledger.reset()
    with commit_path.watching():
        s.coordinator.rows_leaving(batch, [1])  # row 1 ends while row 2 decodes on
    copies = ledger.snapshot()
    ledger.reset()
    assert set(copies) <= {"reply_append.kv", "reply_append.pooled"}, copies  # no whole-row copy
    assert copies["reply_append.kv"] == (PROMPT + REPLY - (PROMPT - 1)) * per_token, copies
    # The pooled windows (one per 16 tokens, small) are copied whole from the row.
    assert copies.get("reply_append.pooled", 0) < (PROMPT + REPLY) * per_token // 8, copies
    assert s.cache.stats["reply_appends"] == 1 and s.cache.stats["reply_row_copies"] == 0
