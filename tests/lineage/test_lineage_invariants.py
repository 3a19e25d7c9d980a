"""``LineageCache.check()`` catches each invariant a bug could break, on a real cache whose state
is corrupted on purpose; the test-side wrapper runs it after every verb; and the fail-closed
handlers re-raise under ``APC_TEST_FAULTS=1`` and stay closed without it."""

from __future__ import annotations

import logging

import pytest

from server_patch.integration import hooks as door
from server_patch.integration.coordinator import LineageCoordinator
from server_patch.failclosed import fail_closed
from server_patch.lineage import Entry, LineageCache, LineageConfig, RestorePlan, SizedSnapshot
from server_patch.lineage.invariants import InvariantError
from tests.lineage_checked import checked_lineage, checks  # noqa: F401 (the fixture)
from tests.lineage.test_lineage_policy import FakeDisk, make, serve, words
from tests.lineage.test_lineage_types import LoanKV
from tests.integration.test_reply_reuse import ids, serve as serve_reply


def conversation(cache: LineageCache | None = None) -> LineageCache:
    """Two turns of one conversation: one entry with checkpoints."""
    cache = cache or make()
    prompt = words(300, 1)
    serve(cache, prompt, segments=(64, 128, 200))
    serve(cache, prompt + words(80, 2), segments=(64, 128, 200, 300))
    cache.check()
    return cache


def broken(cache: LineageCache) -> list[str]:
    with pytest.raises(InvariantError) as caught:
        cache.check()
    assert isinstance(caught.value, AssertionError)
    return caught.value.violations


def test_a_healthy_cache_passes_after_turns_with_replies_rewinds_and_a_disk():
    cache = LineageCache(LineageConfig(disk_write_delay_s=0, max_checkpoints=2), disk=FakeDisk())
    prompt = ids(200, 3)
    for turn in range(4):
        reply = ids(20, 10 + turn)
        serve_reply(cache, prompt, reply, rewind=turn == 2)
        prompt = prompt + reply + ids(40, 20 + turn)
        cache.tick(now=cache.clock() + 60)
        assert cache.check() is None
    assert any(e.prompt_end for e in cache.entries()) and cache.records()


def test_a_wrong_tally_is_named():
    cache = conversation()
    (entry,) = cache.entries()
    entry.checkpoints.pop()  # changed in place without ``resized``
    (found,) = [v for v in broken(cache) if v.startswith(f"entry {entry.id}: counted")]
    assert f"holds {entry.nbytes}" in found
    assert any(v.startswith("RAM tally") for v in broken(cache))


def test_unsorted_and_duplicate_checkpoints_are_named():
    cache = conversation()
    (entry,) = cache.entries()
    entry.checkpoints.reverse()
    assert any("not sorted and unique" in v for v in broken(cache))
    entry.checkpoints.reverse()
    entry.checkpoints.append(entry.checkpoints[-1])
    cache._entries.resized(entry)  # the tally is right: only the order is wrong
    assert [v for v in broken(cache)] == [f"entry {entry.id}: checkpoints not sorted and unique: "
                                          f"{[c.length for c in entry.checkpoints]}"]


def test_a_checkpoint_at_or_past_the_entry_length_is_named():
    cache = conversation()
    (entry,) = cache.entries()
    entry.checkpoints[-1].length = entry.length
    assert broken(cache) == [f"entry {entry.id}: checkpoints [{entry.length}] not inside its "
                             f"{entry.length} tokens"]


def lendable_entry() -> tuple[LineageCache, Entry, RestorePlan]:
    cache = LineageCache(LineageConfig(), disk=FakeDisk())
    prompt = words(120, 4)
    cache.commit(prompt, kv=LoanKV(100, len(prompt) - 1), head=SizedSnapshot(1000))
    (entry,) = cache.entries()
    return cache, entry, RestorePlan(entry.length, "entry", entry=entry)


def test_an_entry_queued_for_writing_is_not_lent_and_a_lent_one_queued_is_named():
    cache, entry, plan = lendable_entry()
    cache._queued.add(entry.id, entry.nbytes)  # the idle tick queued a write, then ...
    cache.check()  # (not lent yet: fine)
    assert cache.lend(plan) is None and not entry.lent  # ... a lookup asks for its rows: refused
    cache._queued.done(entry.id)
    loan = cache.lend(plan)
    assert loan is not None and entry.lent and cache.lend(plan) is None  # one borrower at a time
    entry.kv.lent = True  # the rows lent under the receipt
    cache._entries.resized(entry)
    cache.check()
    assert cache.tick(now=1e12) == 0 and cache.flush() == 0 and not cache.rewind(entry)
    cache._queued.add(entry.id, entry.nbytes)  # a write queued behind the loan's back
    assert broken(cache) == [f"entry {entry.id}: lent and queued for writing"]


def test_a_loan_ends_once_and_rows_lent_without_a_receipt_are_named():
    cache, entry, plan = lendable_entry()
    loan = cache.lend(plan)
    cache.end(loan)
    cache.end(loan)  # a second end of the same receipt counts nothing
    assert entry.loans == 0 and not entry.lent
    cache.check()
    entry.kv.lent = True  # lent around the cache
    cache._entries.resized(entry)
    assert broken(cache) == [f"entry {entry.id}: its buffer is lent without a receipt"]
    entry.kv.lent = False
    entry.loans = 1  # counted, no receipt out
    assert broken(cache) == [f"entry {entry.id}: counts 1 loans, 0 receipts out"]


def test_a_missing_prompt_end_is_named_and_a_head_at_its_prompt_end_needs_none():
    cache = make()
    prompt = ids(200, 5)
    serve_reply(cache, prompt, ids(30, 6))
    (entry,) = cache.entries()
    assert 0 < entry.prompt_end < entry.length
    cache.check()
    entry.checkpoints = [c for c in entry.checkpoints if c.length != entry.prompt_end]
    cache._entries.resized(entry)
    assert broken(cache) == [f"entry {entry.id}: prompt end {entry.prompt_end} has no checkpoint"]
    entry.prompt_end = 0  # reply reuse off, an anchor, a rewound entry: the head is the prompt end
    cache.check()


def test_a_supersede_cycle_and_a_self_supersede_are_named():
    cache = conversation()
    cache._superseded_by.update({"a": "b", "b": "c", "c": "a", "x": "a"})
    assert broken(cache) == ["supersede cycle: a -> b -> c -> a"]
    del cache._superseded_by["c"]
    cache.check()  # a chain that ends
    (entry,) = cache.entries()
    entry.supersedes.append(entry.id)
    assert broken(cache) == [f"entry {entry.id}: supersedes its own file"]


def test_every_violation_found_is_named_at_once():
    cache = conversation()
    (entry,) = cache.entries()
    entry.checkpoints.reverse()
    cache._superseded_by.update({"a": "a"})
    assert len(broken(cache)) == 2


@pytest.mark.usefixtures("checked_lineage")
def test_the_wrapper_checks_after_every_verb():
    cache = conversation()
    before = checks["count"]
    cache.lookup(words(10, 9))
    assert checks["count"] == before + 1
    (entry,) = cache.entries()
    entry.checkpoints.reverse()  # a bug in some verb: the next verb's check names it
    with pytest.raises(InvariantError, match="not sorted"):
        cache.tick()


# ----------------------------------------------------------------------------- failing closed

def test_fail_closed_logs_and_re_raises_only_under_the_test_fault_switch(monkeypatch, caplog):
    log = logging.getLogger("test.failclosed")
    caught = ValueError("boom")
    monkeypatch.delenv("APC_TEST_FAULTS", raising=False)
    with caplog.at_level(logging.WARNING, logger="test.failclosed"):
        fail_closed(caught, "a restore", log=log)
    assert "a restore failed: boom" in caplog.text
    monkeypatch.setenv("APC_TEST_FAULTS", "1")
    with pytest.raises(ValueError, match="boom"):
        fail_closed(caught, "a restore", log=log)


class _BrokenCoordinator(LineageCoordinator):
    """A lineage coordinator (never built: only its leave hook runs) whose leave hook has a bug."""

    def __init__(self) -> None:
        pass

    def rows_leaving(self, batch, keep):
        raise RuntimeError("a bug in rows_leaving")


class _Batch:
    pass


def test_a_copyfree_hook_stays_closed_in_production_and_re_raises_under_the_switch(monkeypatch, caplog):
    batch, coordinator = _Batch(), _BrokenCoordinator()
    monkeypatch.delenv("APC_TEST_FAULTS", raising=False)
    with caplog.at_level(logging.WARNING, logger="server_patch.copyfree"):
        door.rows_leaving(coordinator, batch, [0])  # mlx-vlm's filter goes on
    assert "apc_copyfree leave hook failed: a bug in rows_leaving" in caplog.text
    monkeypatch.setenv("APC_TEST_FAULTS", "1")
    with pytest.raises(RuntimeError, match="a bug in rows_leaving"):
        door.rows_leaving(coordinator, batch, [0])


def test_a_failing_event_observer_never_breaks_the_cache_but_re_raises_under_the_switch(monkeypatch):
    def observer(event):
        raise KeyError("observer bug")

    monkeypatch.delenv("APC_TEST_FAULTS", raising=False)
    cache = LineageCache(LineageConfig(), on_event=observer)
    prompt = words(100, 7)
    serve(cache, prompt)
    assert len(cache.entries()) == 1
    monkeypatch.setenv("APC_TEST_FAULTS", "1")
    with pytest.raises(KeyError, match="observer bug"):
        serve(cache, prompt + words(50, 8))
