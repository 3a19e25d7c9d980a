"""The LOADING state, fast: a queued prompt whose restore point is a disk file waits in the
queue while its file loads on a loader thread (``integration.loading``).

The real ``LineageCache``, ``SessionBook``, ``BackgroundLoads`` (its own loader thread) and
``Admission``; the disk is a stand-in whose loads the test lets through (a gate), so every
assertion is on states and counts, never on times.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from server_patch.disk.loader import BackgroundLoads
from server_patch.integration.loading import DiskLoads
from server_patch.integration.pending import Pending, request_key
from server_patch.integration.session import SessionBook, SessionState
from server_patch.integration.timings import TimingBook
from server_patch.lineage import DISK, LineageCache, LineageConfig, as_tokens
from server_patch.lineage.flow import NOT_LOADED, Admission
from server_patch.lineage.misses import Lost
from tests.lineage.test_lineage_policy import Clock, FakeDisk, serve, words

LOADING, ADMITTED, PREFILLING, ENDED = SessionState.LOADING, SessionState.ADMITTED, SessionState.PREFILLING, SessionState.ENDED


class GatedDisk(FakeDisk):
    """A disk whose loads wait for ``gate`` and answer ``answers[record id]``."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()
        self.answers: dict[str, tuple[Any, str]] = {}
        self.loaded: list[str] = []

    def load_checked(self, record):
        self.gate.wait(30)
        self.loaded.append(record.id)
        return self.answers[record.id]


def on_disk_only(conversation: list[int]) -> SimpleNamespace:
    """A cache whose entry of ``conversation`` is on disk only, its gated disk (answering that
    entry), a book and the loads."""
    disk, book = GatedDisk(), SessionBook(TimingBook())
    cache = LineageCache(LineageConfig(), disk=disk, clock=Clock())
    entry = serve(cache, conversation)[2]
    disk.answers[entry.id] = (entry, "")
    cache.flush()
    cache.clear()  # RAM forgets; the disk remembers
    runtime = SimpleNamespace(cache=cache, disk=disk, refuses=lambda kind: False)
    return SimpleNamespace(cache=cache, disk=disk, book=book, loads=DiskLoads(runtime, book, BackgroundLoads()),
                           entry=entry)


@pytest.fixture
def s():
    """A cache whose conversation entry is on disk only, its disk, a book and the loads."""
    long = words(800, 4100)
    s = on_disk_only(long)
    s.warm, s.cold = as_tokens(long + words(20, 4101)), as_tokens(words(300, 4102))
    return s


def queue_of(*prompts: np.ndarray, first: int = 0) -> list[tuple]:
    """mlx-vlm's queued sequences as the coordinator reads them: (uid, ids, ..., kwargs, ...),
    uids from ``first`` (a uid names one request: another prompt never reuses it)."""
    return [(i, prompt, 8, {}, None, None) for i, prompt in enumerate(prompts, start=first)]


def prompt_of(sequence: tuple) -> tuple[np.ndarray, str]:
    return sequence[1], ""


def until_ready(s, queue: list, limit: int = 8) -> int:
    """Steps with nothing decoding (each poll waits a little) until every prompt is admissible."""
    for _ in range(2000):
        if (n := s.loads.admissible(queue, prompt_of, limit, idle=True)) == len(queue):
            return n
    raise AssertionError("the load never finished")


def lookup(s, prompt: np.ndarray, record=None, uid: Any = 0) -> Admission:
    """The lookup mlx-vlm makes once queued prompt ``uid`` is admitted: the request's disk
    tier (its row's load), then its row."""
    disk = s.loads.for_request(s.book.queued(uid, None), record)
    admission = Admission.admit(s.cache, prompt, "", disk=disk)
    disk.tell(admission)
    s.book.admit(Pending(prompt, "", admission.plan), record, uid=uid)
    return admission


def test_a_disk_restore_waits_loading_while_the_prompts_behind_it_are_admitted(s):
    queue = queue_of(s.warm, s.cold)
    assert s.loads.admissible(queue, prompt_of, 8) == 1
    assert [q[0] for q in queue] == [1, 0]  # the cold prompt first, the loading one behind it
    row = s.book.by_key(request_key("", s.warm))
    assert row.state == LOADING and row.load.record.id == s.entry.id
    s.book.decoded([7], [1])  # the batch goes on decoding meanwhile
    s.book.decoded([7], [2])
    assert s.loads.admissible(queue, prompt_of, 8) == 1 and row.state == LOADING
    s.book.decoded([7], [3])
    s.disk.gate.set()
    assert until_ready(s, queue_of(s.warm)) == 1
    record = s.book.timings.open(len(s.warm))
    admission = lookup(s, s.warm, record)
    assert admission.plan.hit and admission.tier == DISK and admission.plan.length == 799
    assert s.disk.loaded == [s.entry.id]  # loaded once, on the loader thread, none at lookup
    assert row.state == ADMITTED and row.history == [LOADING] and row.load is None
    assert record.loading_steps == 3 and record.loading_ms > 0


def test_a_look_ahead_is_no_lookup_and_a_ram_or_cold_prompt_never_waits(s):
    before = s.cache.stats["lookups"]
    queue = queue_of(s.cold, s.warm)
    assert s.loads.admissible(queue, prompt_of, 1) == 1  # the limit: the second is not looked at
    assert s.cache.stats["lookups"] == before
    assert s.book.by_key(request_key("", s.warm)) is None and s.disk.loaded == []


def test_a_rejected_file_is_forgotten_and_the_request_admitted_cold_having_met_it(s):
    s.disk.answers[s.entry.id] = (None, "hash: tensor data hash does not match")
    s.disk.gate.set()
    until_ready(s, queue_of(s.warm))
    assert s.cache.lookup(s.warm).tier != DISK  # the record is gone: nothing restores from it
    admission = lookup(s, s.warm, s.book.timings.open(len(s.warm)))
    assert not admission.plan.hit
    assert (799, Lost.DISK_REJECTED) in admission.steps and admission.detail.startswith("hash")


def test_a_load_past_the_bound_admits_cold_and_keeps_the_file(s, monkeypatch):
    monkeypatch.setenv("APC_DISK_LOAD_WAIT_MS", "0")
    queue = queue_of(s.warm)
    assert s.loads.admissible(queue, prompt_of, 8) == 1  # started, and already past the bound
    row = s.book.by_key(request_key("", s.warm))
    assert row.load.late
    admission = lookup(s, s.warm)
    assert not admission.plan.hit and (799, Lost.DISK_UNUSED) in admission.steps
    assert admission.detail == NOT_LOADED
    s.disk.gate.set()  # the load finishes late: nobody takes it
    assert s.cache.lookup(s.warm).tier == DISK  # the file is kept


def test_a_request_that_leaves_the_queue_while_loading_ends_there(s):
    queue = queue_of(s.warm)
    assert s.loads.admissible(queue, prompt_of, 8) == 0
    row = s.book.by_key(request_key("", s.warm))
    assert s.loads.admissible(queue_of(s.cold, first=1), prompt_of, 8) == 1  # cancelled: gone from the queue
    assert row.state == ENDED and row.history == [LOADING] and row not in s.book.rows()
    s.disk.gate.set()


def test_loading_leads_only_to_admitted_or_ended(monkeypatch):
    monkeypatch.setenv("APC_TEST_FAULTS", "0")
    book = SessionBook(TimingBook())
    row = book.loading(Pending(as_tokens(words(20, 4103)), "", None), load=object())
    assert row.state == LOADING and not row.prefilling
    assert book.bind(row.key, uid=1) is None and row.state == LOADING  # not before its lookup
    assert not row.move(PREFILLING, "bind") and row.state == LOADING
    assert row.move(ADMITTED, "admit") and book.bind(row.key, uid=1) is row and row.state == PREFILLING
    assert not row.move(LOADING, "again") and row.state == PREFILLING


def test_identical_prompts_queued_together_wait_each_in_its_own_row_and_read_the_file_once(s):
    """Twins (issue 35) are two LOADING rows, one per uid; the file is read once: the second
    waits for the first's lookup to promote it, then restores from RAM."""
    queue = [(0, s.warm, 8, {}, None, None), (1, s.warm, 8, {}, None, None)]
    assert s.loads.admissible(queue, prompt_of, 8) == 0
    rows = [s.book.by_uid(0), s.book.by_uid(1)]
    assert rows[0] is not rows[1] and [r.state for r in rows] == [LOADING, LOADING]
    s.disk.gate.set()
    for _ in range(2000):
        if s.loads.admissible(queue, prompt_of, 8, idle=True) >= 1:
            break
    one, other = queue[0][0], queue[1][0]  # whichever took the read first is ready first
    first = lookup(s, s.warm, uid=one)
    assert first.tier == DISK and s.book.by_uid(other).state == LOADING
    assert until_ready(s, [(other, s.warm, 8, {}, None, None)]) == 1
    second = lookup(s, s.warm, uid=other)
    assert second.plan.hit and second.tier != DISK  # from RAM: the twin's promoted entry
    assert s.disk.loaded == [s.entry.id]  # read once
    assert [r.state for r in rows] == [ADMITTED, ADMITTED]  # each admitted, its own row
