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
    assert FORBIDS[BASE] == {REWIND} and FORBIDS[DEFERRED] == frozenset()  # evicted last, not pinned
    assert EVICT not in FORBIDS[BASE]
    assert WRITING not in FORBIDS[BASE] and LENDING not in FORBIDS[BASE]  # its rows below its length stay as they are


def test_a_base_held_entry_is_evicted_after_the_others_and_release_lets_it_go(pressed):
    cache, entries = pressed
    oldest = entries[0]  # least recently used: the first to go under pressure
    assert cache.base("row", oldest)
    serve(cache, words(800, 4700))  # a commit past the budget: what nobody holds goes first
    assert cache.get(oldest.id) is oldest, "the entry a decoding row's reply extends was evicted"
    assert cache.get(entries[1].id) is None  # the next least recently used went instead
    assert cache.release("row", (BASE,)) == 1  # the row committed (or ended): its base is let go
    serve(cache, words(800, 4701))
    assert cache.get(oldest.id) is None and cache.ram_used <= cache.config.ram_budget_bytes


def test_the_budget_stays_a_bound_when_decoding_rows_hold_every_entry(pressed):
    """Decision 0013, amended: a base is evicted last, not pinned. With every entry held by a
    decoding row, a commit past the budget evicts the least recently used of them (its row will
    copy at its end) rather than exceeding the budget (a fresh-clone run of the parallel budget
    test measured up to 40 kB over 600 kB while rows pinned their bases)."""
    cache, entries = pressed
    for i, entry in enumerate(entries):
        assert cache.base(f"row{i}", entry)
    assert cache.ram_used > cache.config.ram_budget_bytes  # three entries, a budget of two and a half
    newest = serve(cache, words(800, 4702))[2]
    assert newest is None  # the new commit, nobody's base, left RAM first (written)
    assert cache.ram_used <= cache.config.ram_budget_bytes
    assert cache.get(entries[0].id) is None  # then the least recently used base: its row will copy
    assert all(cache.get(e.id) is e for e in entries[1:])
    for i in range(3):
        cache.release(f"row{i}")  # the one release at each row's end: a gone base is let go too
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
