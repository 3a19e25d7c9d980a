"""A decoding request's commit holds (issue 35, decision 0013): the entry its reply is appended
to (``BASE``) and a lone row's deferred buffer (``DEFERRED``) are holds of the one primitive,
checked in the one place (``holds.FORBIDS``) and let go by ``release(owner)``.

Under RAM pressure a ``BASE``-held entry is not evicted (the budget is exceeded while nothing
else can leave, one such entry per decoding row) nor rewound; an operator's evict still wins.
A ``DEFERRED`` hold names no entry and counts nothing. The real ``LineageCache`` over sized
handles; invariants are checked after every verb.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from server_patch.lineage import LineageCache, LineageConfig, RestorePlan
from server_patch.lineage.holds import BASE, DEFERRED, EVICT, FORBIDS, LENDING, REWIND, WRITING
from tests.lineage.test_lineage_policy import Clock, FakeDisk, serve, words
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")


@pytest.fixture
def pressed():
    """Three conversations' entries in RAM and a budget of about two of them."""
    cache = LineageCache(LineageConfig(), disk=FakeDisk(), clock=Clock())
    entries = [serve(cache, words(800, 4600 + i))[2] for i in range(3)]
    cache.config = replace(cache.config, ram_budget_bytes=max(e.nbytes for e in entries) * 5 // 2)
    return cache, entries


def test_the_table_says_what_a_base_and_a_deferral_forbid():
    assert FORBIDS[BASE] == {EVICT, REWIND} and FORBIDS[DEFERRED] == frozenset()
    assert WRITING not in FORBIDS[BASE] and LENDING not in FORBIDS[BASE]  # its rows below its length stay as they are


def test_a_base_held_entry_is_not_evicted_under_pressure_and_release_lets_it_go(pressed):
    cache, entries = pressed
    oldest = entries[0]  # least recently used: the first to go under pressure
    assert cache.base("row", oldest)
    serve(cache, words(800, 4700))  # a commit past the budget: only what nobody holds may go
    assert cache.get(oldest.id) is oldest, "the entry a decoding row's reply extends was evicted"
    assert cache.get(entries[1].id) is None  # the next least recently used went instead
    assert cache.release("row", (BASE,)) == 1  # the row committed (or ended): its base is let go
    serve(cache, words(800, 4701))
    assert cache.get(oldest.id) is None and cache.ram_used <= cache.config.ram_budget_bytes


def test_the_budget_is_exceeded_only_by_what_decoding_rows_hold_and_only_until_they_let_go(pressed):
    cache, entries = pressed
    for i, entry in enumerate(entries):
        assert cache.base(f"row{i}", entry)
    newest = serve(cache, words(800, 4702))[2]
    assert all(cache.get(e.id) is e for e in entries)  # held: over the budget, transiently
    assert newest is None and len(cache.entries()) == 3  # the one nobody holds left RAM at once (written)
    assert cache.config.ram_budget_bytes < cache.ram_used == sum(e.nbytes for e in entries)
    for i in range(3):
        cache.release(f"row{i}")  # the one release at each row's end
    assert cache.ram_used <= cache.config.ram_budget_bytes


def test_a_base_held_entry_is_not_rewound_and_an_operators_evict_still_wins():
    cache = LineageCache(LineageConfig(), clock=Clock())
    prompt, reply = words(300, 4800), words(20, 4801)
    end = len(prompt) - cache.config.entry_offset
    from tests.lineage.test_lineage_policy import KV_PER_TOKEN, SNAP, SizedKV, SizedSnapshot
    entry = cache.commit_reply(prompt, reply, kv=SizedKV(KV_PER_TOKEN, end + len(reply) + 1),
                               head=SizedSnapshot(SNAP), prompt_head=SizedSnapshot(SNAP))
    assert entry is not None and entry.prompt_end == end
    assert cache.base("row", entry)
    assert not cache.rewind(entry)  # the row's reply is appended past its head: not given up
    assert cache.lend(RestorePlan(entry.length, "entry", entry=entry)) is not None  # lending is not its to forbid
    cache.release("row")
    assert cache.evict(entry.id)
    assert not cache.base("row", entry)  # gone: nothing held, the holder copies (fails closed)
    assert cache.release("row") == 0


def test_a_deferral_counts_nothing_pins_nothing_and_release_lets_it_go(pressed):
    cache, entries = pressed
    used = cache.ram_used
    cache.defer("row", "deferred:7")  # a lone row's own buffer: mlx-vlm's memory while it decodes
    assert cache.ram_used == used and [h.kind for h in cache._holds.of("row")] == [DEFERRED]
    assert cache.base("row", entries[0])
    assert cache.release("row") == 2 and cache._holds.of("row") == []
