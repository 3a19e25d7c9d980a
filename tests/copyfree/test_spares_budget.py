"""The joint batch buffers made ahead (``copyfree.spares.JointSpares``, issue 40) count in the
RAM budget: twice the staged row's bytes, reserved before they are made and only in the budget's
free room (they never evict an entry), let go once a join has taken the last of them, or when
they are dropped or replaced.

The real ``LineageCache`` over sized handles (its invariants checked after every verb), real
mlx buffers for the spares.
"""

from __future__ import annotations

from dataclasses import replace

import mlx.core as mx
import pytest

from server_patch.copyfree.spares import JointSpares
from server_patch.lineage import LineageCache, LineageConfig
from tests.lineage.test_lineage_policy import Clock, FakeDisk, serve, words
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")

ROW = (1, 2, 512, 16)  # a staged row's KV child: [1, heads, capacity, dim]
JOINT = (2, 2, 512, 16)  # the 2-row joint batch its join writes into
JOINT_BYTES = 2 * (2 * 2 * 512 * 16 * 2)  # keys and values of the joint batch, bfloat16


def _staged() -> list[mx.array]:
    return [mx.zeros(ROW, dtype=mx.bfloat16), mx.zeros(ROW, dtype=mx.bfloat16)]


@pytest.fixture
def cache() -> LineageCache:
    return LineageCache(LineageConfig(), disk=FakeDisk(), clock=Clock())


def test_spares_count_in_ram_used_until_the_join_takes_the_last(cache: LineageCache) -> None:
    spares = JointSpares(cache)
    before = cache.budgets()
    spares.reserve(_staged())
    after = cache.budgets()
    assert after["ram_used"] - before["ram_used"] == spares.held_bytes() == JOINT_BYTES
    assert after["loading_bytes"] - before["loading_bytes"] == JOINT_BYTES  # reported beside staged copies
    assert cache.ram_used == after["ram_used"]
    spares.take(JOINT, mx.bfloat16)  # the join's keys: the values' spare is still held
    assert cache.budgets()["ram_used"] == after["ram_used"]
    spares.take(JOINT, mx.bfloat16)  # the last: the buffers are the decoding batch's now
    assert spares.count() == 0 and cache.budgets()["ram_used"] == before["ram_used"]


def test_replaced_or_dropped_spares_leave_the_budget(cache: LineageCache) -> None:
    spares = JointSpares(cache)
    base = cache.ram_used
    spares.reserve(_staged())
    spares.reserve(_staged())  # a later staging's: only the latest set is kept, and counted
    assert cache.ram_used - base == JOINT_BYTES
    assert spares.drop() == 2 and cache.ram_used == base
    spares.reserve(_staged())
    spares.take((2, 2, 64, 16), mx.bfloat16)  # too narrow a join: allocates, the spares stay counted
    assert spares.count() == 2 and cache.ram_used - base == JOINT_BYTES
    spares.drop()
    assert cache.ram_used == base


def test_spares_are_made_only_in_the_budgets_free_room(cache: LineageCache) -> None:
    """A set that does not fit beside the entries is not made (the join allocates): it evicts no
    cached conversation and never takes the budget past its limit (a fresh-clone run had 1.9 MB
    of spares over a 600 kB budget while eight conversations joined). Where it fits, it is made."""
    entries = [serve(cache, words(200, 5100 + i))[2] for i in range(2)]
    held = sum(e.nbytes for e in entries)
    cache.config = replace(cache.config, ram_budget_bytes=held + JOINT_BYTES - 1)  # not both beside them
    assert cache.ram_used == held
    spares = JointSpares(cache)
    spares.reserve(_staged())
    assert spares.count() == 0 and cache.ram_used == held
    assert all(cache.get(e.id) is not None for e in entries)  # nothing left RAM for them
    cache.config = replace(cache.config, ram_budget_bytes=held + JOINT_BYTES)
    spares.reserve(_staged())
    assert spares.count() == 2 and cache.ram_used == cache.config.ram_budget_bytes


def test_spares_without_a_budget_count_nowhere() -> None:
    spares = JointSpares()  # a bench's: nothing to count them in
    spares.reserve(_staged())
    assert spares.held_bytes() == JOINT_BYTES and spares.drop() == 2
