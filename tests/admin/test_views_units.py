"""Issue 36 (6, 7, 8, 9) at the cache the admin views read, over sized handles (no server):
hits carry their last hit through absorption, an absorbed id names its absorber, pinned anchors
held only as files are counted, and a restore whose state came from disk counts as ``disk``.
The same facts through a real server: ``test_views_agree.py``."""

from __future__ import annotations

import numpy as np
import pytest

from server_patch.lineage import DISK, DiskRecord, LineageCache, LineageConfig
from server_patch.lineage.summary import hit_summary
from tests.lineage.test_lineage_policy import Clock, FakeDisk, make, serve, words
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")


def conversation(cache: LineageCache, turns: int) -> list:
    prompt, entries = words(400, 1), []
    for turn in range(turns):
        entries.append(serve(cache, prompt)[2])
        prompt = prompt + words(30, 100 + turn)
    return entries


def test_an_entry_with_hits_has_a_last_hit_after_absorbing_the_turn_before() -> None:
    cache = make()
    conversation(cache, 3)
    (entry,) = cache.entries()
    assert entry.hits == 2 and entry.last_hit is not None


def test_an_absorbed_id_names_the_entry_that_holds_its_state_now() -> None:
    cache = make()
    first, second, third = conversation(cache, 3)
    assert cache.absorbed_into(first.id) == third.id and cache.absorbed_into(second.id) == third.id
    assert cache.absorbed_into(third.id) is None and cache.absorbed_into("nothing") is None


def test_pinned_anchors_held_only_as_files_are_counted() -> None:
    tokens = np.array(words(300, 7), np.int32)
    files = [DiskRecord("pinned", tokens, "", (), 10, 0.0, is_anchor=True, pinned=True),
             DiskRecord("unpinned", tokens[:200], "", (), 10, 0.0, is_anchor=True, pinned=False),
             DiskRecord("talk", tokens[:100], "", (), 10, 0.0)]
    cache = LineageCache(LineageConfig(), disk=FakeDisk(files), clock=Clock())
    budgets = cache.budgets()
    assert (budgets["anchor_count"], budgets["pinned_on_disk"]) == (0, 1)
    cache.evict("pinned")
    assert cache.budgets()["pinned_on_disk"] == 0


def test_a_restore_whose_state_came_from_disk_counts_as_disk_with_its_point() -> None:
    cache = make()
    prompt = words(400, 3)
    serve(cache, prompt)
    plan = cache.lookup(prompt + words(20, 4))  # a RAM plan, as after its file was promoted for it
    assert plan.tier == "ram" and plan.kind == "entry"
    cache.note_restore(plan, tier=DISK)
    summary = hit_summary(cache.stats)
    assert summary["by_kind"]["disk"] == 1 and summary["by_kind"].get("entry", 0) == 0
    assert summary["disk_by_point"] == {"entry": 1}


def test_a_restart_probes_eviction_is_counted_apart_from_an_operators() -> None:
    cache = make()
    first, second = (serve(cache, words(300, seed))[2] for seed in (11, 12))
    cache.evict(first.id)
    cache.evict(second.id, "restart probe")
    assert (cache.stats["operator_evictions"], cache.stats["probe_evictions"]) == (1, 1)
