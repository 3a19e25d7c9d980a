"""The lineage policy over sized handles: every event, rule and corner case of the design."""

from __future__ import annotations

import numpy as np
import pytest

from server_patch.lineage import (
    ANCHOR, DIVERGENCE, FINAL, GUARD, PERIODIC, SEGMENT, CacheError, DiskRecord, Entry,
    LineageCache, LineageConfig, Loan, RestorePlan, SizedKV, SizedSnapshot,
)
from server_patch.lineage.flow import Admission
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

KV_PER_TOKEN = 100
SNAP = 1000


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def make(**overrides) -> LineageCache:
    overrides.setdefault("guard_tokens", 16)  # most tests exercise the guard rule too
    return LineageCache(LineageConfig(**overrides), clock=Clock())


def words(n: int, seed: int) -> list[int]:
    return list(np.random.RandomState(seed).randint(10, 30000, n))


def serve(cache: LineageCache, prompt, *, anchor_len=None, segments=(), namespace=""):
    """One request through the server's own flow: admission, capture plan, prefill, commit."""
    flow = Admission.admit(cache, prompt, namespace)
    plan = flow.plan
    caps = flow.captures(anchor_len=anchor_len, segments=segments)
    flow.restored() if plan.hit else flow.cold()
    end = len(prompt) - cache.config.entry_offset
    captures = {c.length: (c.kind, SizedSnapshot(SNAP)) for c in caps}
    entry = flow.commit(kv=SizedKV(KV_PER_TOKEN, end), head=SizedSnapshot(SNAP), captures=captures)
    return plan, caps, entry


def kinds(entry: Entry) -> list[tuple[int, str]]:
    return [(c.length, c.kind) for c in entry.checkpoints]


# ----------------------------------------------------------------------------- lineage

def test_multi_turn_conversation_keeps_one_entry_and_hits_it_every_turn():
    cache = make()
    prompt = words(400, 1)
    previous = None
    for turn in range(5):
        plan, _, entry = serve(cache, prompt)
        if previous is None:
            assert plan.kind == "cold"
        else:
            assert (plan.kind, plan.length) == ("entry", len(previous) - 1)
        previous = prompt
        prompt = prompt + words(30, 100 + turn)
    assert len(cache.entries()) == 1
    assert cache.stats["absorbs"] == 4


def test_absorption_turns_the_old_head_into_a_final_checkpoint_and_carries_checkpoints():
    cache = make(guard_min_suffix=100)
    first = words(300, 2)
    _, caps, e1 = serve(cache, first)
    assert [c.kind for c in caps] == [GUARD]
    second = first + words(50, 3)
    _, _, e2 = serve(cache, second)
    assert kinds(e2) == [(284, GUARD), (299, FINAL)]
    assert cache.get(e1.id) is None


def test_default_layout_captures_no_guard():
    cache = LineageCache(LineageConfig(), clock=Clock())
    _, caps, _ = serve(cache, words(3000, 3))
    assert GUARD not in {c.kind for c in caps}


def test_entry_sits_at_n_minus_1_and_is_its_own_resend_point():
    cache = make()
    prompt = words(500, 4)
    _, _, entry = serve(cache, prompt)
    assert entry.length == 499
    plan, caps, again = serve(cache, prompt)  # verbatim resend (regenerate, retry)
    assert (plan.kind, plan.length) == ("entry", 499)
    assert caps == [] and again is entry and len(cache.entries()) == 1


def test_post_layout_resend_lands_on_guard_or_previous_turn_boundary():
    """With the entry at n (the post's layout) a resend needs the guard or a turn boundary."""
    cache = make(entry_offset=0)
    long_turn = words(600, 5)
    serve(cache, long_turn)
    plan, _, _ = serve(cache, long_turn)
    assert (plan.kind, plan.length) == (GUARD, 584)

    short_turn = long_turn + words(7, 6)  # a 7-token question never gets a guard...
    _, caps, _ = serve(cache, short_turn)
    assert all(c.kind != GUARD for c in caps)
    plan, _, _ = serve(cache, short_turn)  # ...so its resend restores at the turn boundary
    assert (plan.kind, plan.length) == (FINAL, 600)


def test_guard_only_when_uncached_suffix_reaches_the_threshold():
    cache = make()
    base = words(300, 7)
    _, caps, _ = serve(cache, base)
    assert (GUARD in [c.kind for c in caps]) is True  # 299 uncached ≥ 256
    _, caps, _ = serve(cache, base + words(7, 8))
    assert caps == []
    grown = base + words(7, 8)
    _, caps, _ = serve(cache, grown + words(255, 9))  # 255 uncached tokens: one short
    assert caps == []
    _, caps, _ = serve(cache, grown + words(255, 9) + words(256, 10))
    assert [c.kind for c in caps] == [GUARD]


def test_edited_last_message_snaps_to_a_checkpoint_possibly_later_than_the_turn_boundary():
    cache = make(guard_min_suffix=64)
    turn1 = words(200, 11)
    serve(cache, turn1)
    question = words(120, 12)
    turn2 = turn1 + question
    _, _, entry = serve(cache, turn2)
    assert kinds(entry) == [(184, GUARD), (199, FINAL), (304, GUARD)]
    # The edit keeps the first 110 words of the question: it lands on the guard, not the boundary.
    edited = turn1 + question[:110] + words(20, 13)
    plan = cache.lookup(edited)
    assert (plan.kind, plan.length) == (GUARD, 304)
    # An edit early in the question lands on the turn boundary.
    edited = turn1 + question[:5] + words(20, 14)
    plan = cache.lookup(edited)
    assert (plan.kind, plan.length) == (FINAL, 199)


# ----------------------------------------------------------------------------- anchors

def test_new_session_with_the_same_system_prompt_lands_on_the_anchor():
    cache = make()
    system = words(1000, 20)
    serve(cache, system + words(40, 21), anchor_len=1000)
    anchors = [e for e in cache.entries() if e.is_anchor]
    assert len(anchors) == 1 and anchors[0].pinned and anchors[0].length == 1000
    assert anchors[0].kv.nbytes == 1000 * KV_PER_TOKEN
    plan, caps, _ = serve(cache, system + words(25, 22), anchor_len=1000)
    assert (plan.kind, plan.length) == (ANCHOR, 1000)
    assert all(c.kind != ANCHOR for c in caps)  # once per distinct prefix
    assert sum(e.is_anchor for e in cache.entries()) == 1


def test_anchor_is_pinned_even_when_it_falls_after_the_guard_point():
    """The post's live bug: a 10k system block and a 7-token question put the anchor past n-16."""
    cache = make(entry_offset=0)
    system = words(10_000, 23)
    prompt = system + words(7, 24)
    _, caps, _ = serve(cache, prompt, anchor_len=len(system) + 3)
    planned = {(c.length, c.kind) for c in caps}
    assert {(10_003, ANCHOR), (10_007 - 16, GUARD)} <= planned
    assert any(e.is_anchor and e.length == 10_003 for e in cache.entries())


def test_anchor_at_the_prefill_end_is_the_head_and_is_still_pinned():
    cache = make()
    prompt = words(500, 25)
    _, caps, _ = serve(cache, prompt, anchor_len=499)
    assert (499, ANCHOR) in [(c.length, c.kind) for c in caps]
    assert any(e.is_anchor and e.length == 499 for e in cache.entries())


def test_anchors_are_not_absorbed_and_are_exempt_from_conversation_lru():
    cache = make(ram_budget_bytes=250_000)
    system = words(600, 26)
    serve(cache, system + words(30, 27), anchor_len=600)
    for i in range(6):
        serve(cache, words(500, 200 + i))  # unrelated conversations fill the budget
    assert any(e.is_anchor for e in cache.entries())
    assert cache.stats["evictions"] >= 3


def test_anchor_caps_count_and_bytes():
    cache = make(anchor_max_entries=3)
    for i in range(5):
        serve(cache, words(400, 30 + i) + words(20, 40 + i), anchor_len=400)
    assert sum(e.is_anchor for e in cache.entries()) == 3
    cache = make(anchor_max_bytes=2 * (400 * KV_PER_TOKEN + SNAP))
    for i in range(4):
        serve(cache, words(400, 50 + i) + words(20, 60 + i), anchor_len=400)
    assert sum(e.is_anchor for e in cache.entries()) == 2


def test_operator_pin_unpin_evict():
    cache = make()
    _, _, entry = serve(cache, words(300, 70))
    cache.pin(entry.id)
    assert entry.pinned and entry.is_anchor
    cache.unpin(entry.id)
    assert not entry.pinned
    freed = cache.evict(entry.id)
    assert freed == entry.nbytes and cache.get(entry.id) is None
    with pytest.raises(CacheError):
        cache.evict(entry.id)


# ----------------------------------------------------------------------------- divergence

def test_second_system_prompt_variant_reuses_nearly_all_through_a_divergence_checkpoint():
    cache = make()
    system = words(3000, 80)
    variant = system[:-4] + words(4, 81)  # differs by 4 tokens near its end
    serve(cache, system + words(30, 82), anchor_len=3000)
    # First session of the variant: the best earlier checkpoint (periodic fallback at 2048).
    plan, caps, _ = serve(cache, variant + words(30, 83), anchor_len=3000)
    assert (plan.kind, plan.length) == (PERIODIC, 2048)
    assert (2996, DIVERGENCE) in [(c.length, c.kind) for c in caps]
    # From its second session on, the divergence checkpoint carries ~all of it.
    plan, _, _ = serve(cache, variant + words(30, 84), anchor_len=3000)
    assert plan.length >= 2996


def test_divergence_needs_the_configured_minimum_gain():
    cache = make(periodic_stride=0, divergence_min_gain=256)
    base = words(1000, 90)
    serve(cache, base)
    _, caps, _ = serve(cache, base[:200] + words(400, 91))
    assert all(c.kind != DIVERGENCE for c in caps)  # gain 200 < 256
    _, caps, _ = serve(cache, base[:700] + words(400, 92))
    assert (700, DIVERGENCE) in [(c.length, c.kind) for c in caps]


# ----------------------------------------------------------------------------- periodic / stock floor

def stock_reuse(history: list[list[int]], prompt: list[int], stride: int = 2048) -> int:
    """The most stock 0.7.10 exact mode could reuse with unbounded RAM: n-1 and stride points."""
    best = 0
    for old in history:
        points = [len(old) - 1] + list(range(stride, len(old) - 1, stride))
        for p in points:
            if p <= len(prompt) - 1 and prompt[:p] == old[:p]:
                best = max(best, p)
    return best


def test_never_reuses_fewer_tokens_than_stock_on_mid_prompt_divergence():
    cache = make()
    rng = np.random.RandomState(95)
    base = words(5000, 96)
    history = []
    for i in range(12):
        cut = int(rng.randint(100, 4900))
        prompt = base[:cut] + words(int(rng.randint(20, 600)), 300 + i)
        plan, _, _ = serve(cache, prompt)
        assert plan.length >= stock_reuse(history, prompt)
        history.append(prompt)


def test_periodic_checkpoint_at_the_last_stride_multiple():
    cache = make(periodic_stride=1024)
    _, caps, _ = serve(cache, words(3000, 97))
    assert (2048, PERIODIC) in [(c.length, c.kind) for c in caps]


# ----------------------------------------------------------------------------- thinning

def test_thinning_keeps_four_checkpoints_dropping_stale_guards_then_oldest_turns():
    cache = make(guard_min_suffix=50, periodic_stride=0)
    prompt = words(100, 110)
    serve(cache, prompt)
    for turn in range(6):
        prompt = prompt + words(60, 120 + turn)
        _, _, entry = serve(cache, prompt)
        assert len(entry.checkpoints) <= 4
    guards = [c for c in entry.checkpoints if c.kind == GUARD]
    assert len(guards) == 1 and guards[0].length == len(prompt) - 16  # only the live one
    finals = [c.length for c in entry.checkpoints if c.kind == FINAL]
    assert finals == sorted(finals)[-3:] and max(finals) == len(prompt) - 61


def test_thinning_drops_periodic_before_turn_boundaries_and_segments_first():
    cache = make(periodic_stride=256, max_checkpoints=2, segment_min_gap=10)
    prompt = words(600, 130)
    _, _, entry = serve(cache, prompt, segments=[100, 200])
    # The newest turn keeps its periodic point and the start of its last message (200); the
    # other segment goes first.
    assert kinds(entry) == [(200, SEGMENT), (512, PERIODIC)]
    prompt2 = prompt + words(40, 131)
    _, _, entry = serve(cache, prompt2)
    # No longer the newest turn's: segments go before periodic points, turn boundaries stay.
    assert kinds(entry) == [(512, PERIODIC), (599, FINAL)]


def test_segment_boundaries_respect_the_minimum_gap():
    cache = make(periodic_stride=0)
    caps = cache.plan_captures(words(2000, 140), cache.lookup(words(2000, 140)),
                               segments=[100, 300, 450, 1000, 1990])
    assert [(c.length, c.kind) for c in caps if c.kind == SEGMENT] == [(300, SEGMENT), (1000, SEGMENT)]


# ----------------------------------------------------------------------------- budgets

def test_ram_budget_really_exceeded_evicts_least_recently_used_lineage():
    entry_bytes = 499 * KV_PER_TOKEN + SNAP
    cache = make(ram_budget_bytes=int(2.5 * entry_bytes), periodic_stride=0, guard_min_suffix=10_000)
    a, b, c = words(500, 150), words(500, 151), words(500, 152)
    serve(cache, a)
    serve(cache, b)
    assert cache.ram_bytes == 2 * entry_bytes
    serve(cache, a)  # touch a: b is now least recently used
    serve(cache, c)
    assert cache.ram_bytes <= cache.config.ram_budget_bytes
    lengths = {tuple(e.tokens[:3]) for e in cache.entries()}
    assert tuple(b[:3]) not in lengths and tuple(a[:3]) in lengths
    assert cache.stats["evictions"] == 1


def test_namespaces_never_share_entries():
    cache = make()
    prompt = words(300, 160)
    serve(cache, prompt, namespace="tenant-a")
    assert cache.lookup(prompt, "tenant-b").kind == "cold"
    assert cache.lookup(prompt, "tenant-a").kind == "entry"


# ----------------------------------------------------------------------------- disk bookkeeping

class FakeDisk:
    """A disk tier that writes instantly and remembers sizes."""

    def __init__(self, records=()):
        self.files: dict[str, DiskRecord] = {r.id: r for r in records}
        self.deleted: list[str] = []
        self.written: list[str] = []

    def records(self):
        return list(self.files.values())

    def write(self, entry, done):
        record = DiskRecord(entry.id, entry.tokens, entry.namespace,
                            tuple((c.length, c.kind) for c in entry.checkpoints), entry.nbytes,
                            0.0, entry.is_anchor, entry.pinned)
        self.files[entry.id] = record
        self.written.append(entry.id)
        done(entry, record)

    def delete(self, record_id):
        self.files.pop(record_id, None)
        self.deleted.append(record_id)


def test_idle_entries_are_written_and_superseded_files_deleted_after_the_successor():
    disk = FakeDisk()
    clock = Clock()
    cache = LineageCache(LineageConfig(disk_write_delay_s=30, guard_tokens=16), disk=disk, clock=clock)
    prompt = words(300, 170)
    _, _, first = serve(cache, prompt)
    assert cache.tick() == 0  # still hot
    clock.now += 60
    assert cache.tick() == 1 and first.id in disk.files
    _, _, second = serve(cache, prompt + words(30, 171))
    assert first.id in disk.files  # kept until its successor is on disk
    clock.now += 60
    cache.tick()
    assert second.id in disk.files and first.id not in disk.files


def test_disk_consulted_only_for_something_longer_than_ram():
    disk = FakeDisk()
    cache = LineageCache(LineageConfig(), disk=disk, clock=Clock())
    long = words(800, 180)
    _, _, entry = serve(cache, long)
    cache.flush()
    cache.clear()  # RAM forgets; disk remembers
    short = long[:300]
    serve(cache, short)
    plan = cache.lookup(long + words(10, 181))
    assert (plan.tier, plan.length, plan.record.id) == ("disk", 799, entry.id)
    plan = cache.lookup(short + words(10, 182))
    assert plan.tier == "ram"


def test_disk_cap_evicts_pinned_anchor_files_last():
    disk = FakeDisk()
    per_file = 299 * KV_PER_TOKEN + SNAP
    cache = LineageCache(LineageConfig(disk_max_bytes=int(3.5 * per_file), periodic_stride=0,
                                       guard_min_suffix=10_000), disk=disk, clock=Clock())
    serve(cache, words(300, 190) + words(5, 191), anchor_len=300)  # anchor written at once
    anchor_id = next(e.id for e in cache.entries() if e.is_anchor)
    for i in range(6):
        serve(cache, words(300, 192 + i))
    cache.flush()
    assert anchor_id in disk.files
    assert cache.disk_bytes <= cache.config.disk_max_bytes
    assert cache.stats["disk_evictions"] >= 2


def test_failed_disk_load_forgets_the_record_and_the_request_goes_cold():
    record = DiskRecord("bad", np.array(words(400, 200), np.int32), "", (), 10, 0.0)
    disk = FakeDisk([record])
    cache = LineageCache(LineageConfig(), disk=disk, clock=Clock())
    prompt = words(400, 200) + words(5, 201)
    plan = cache.lookup(prompt)
    assert plan.tier == "disk"
    assert cache.promote(plan.record, None) is None
    assert cache.lookup(prompt).kind == "cold"


# ----------------------------------------------------------------------------- config

def test_config_from_env_and_the_master_switch():
    cfg = LineageConfig.from_env({"APC_LINEAGE": "0", "APC_LINEAGE_MAX_CHECKPOINTS": "6",
                                  "APC_LINEAGE_RAM_BUDGET_BYTES": "2G",
                                  "APC_LINEAGE_THIN_ORDER": "stale_guard,periodic,turn"})
    assert not cfg.enabled and cfg.max_checkpoints == 6 and cfg.ram_budget_bytes == 2 << 30
    assert cfg.thin_order == ("stale_guard", "periodic", "turn")
    with pytest.raises(ValueError, match="APC_LINEAGE_MAX_CHECKPOINTS"):
        LineageConfig.from_env({"APC_LINEAGE_MAX_CHECKPOINTS": "many"})
    with pytest.raises(ValueError, match="thinning"):
        LineageConfig.from_env({"APC_LINEAGE_THIN_ORDER": "random"})


def test_anchor_adopts_segment_checkpoints_inside_the_system_prefix():
    """The end of the tools block is what the next agent variant needs: the pinned anchor keeps it."""
    cache = make(periodic_stride=0)
    tools_end, system_end = 600, 1200
    system = words(system_end, 210)
    _, caps, entry = serve(cache, system + words(40, 211), anchor_len=system_end,
                           segments=[tools_end, system_end])
    anchor = next(e for e in cache.entries() if e.is_anchor)
    assert kinds(anchor) == [(tools_end, SEGMENT)]
    assert all(c.length >= system_end for c in entry.checkpoints)
    # A variant whose system text differs after the tools block restores at the tools end.
    variant = system[:tools_end] + words(600, 212) + words(40, 213)
    plan = cache.lookup(variant)
    assert (plan.kind, plan.length, plan.entry) == (SEGMENT, tools_end, anchor)



def test_a_failed_disk_write_keeps_the_entry_dirty_for_the_next_flush():
    class FlakyDisk(FakeDisk):
        fail = True

        def write(self, entry, done):
            if self.fail:
                raise RuntimeError("disk full")
            super().write(entry, done)

    disk = FlakyDisk()
    cache = LineageCache(LineageConfig(), disk=disk, clock=Clock())
    _, _, entry = serve(cache, words(300, 230))
    assert cache.flush() == 1
    assert entry.dirty and cache.stats["disk_write_failures"] == 1 and not disk.files
    disk.fail = False
    assert cache.flush() == 1 and entry.id in disk.files and not entry.dirty


# ----------------------------------------------------------------------------- budgets that bound

class LendableKV(SizedKV):
    """Sized KV rows that can be lent to a running request (then neither evicted nor written)."""

    lent = False


class QueuedDisk(FakeDisk):
    """A disk whose writer is a queue the test drains (``land``), like the real writer thread."""

    writes_in_background = True

    def __init__(self, records=()):
        super().__init__(records)
        self.queue: list = []

    def write(self, entry, done):
        self.queue.append((entry, done))

    def land(self):
        while self.queue:
            entry, done = self.queue.pop(0)
            FakeDisk.write(self, entry, done)


def serve_lendable(cache, prompt):
    end = len(prompt) - cache.config.entry_offset
    kv = LendableKV(KV_PER_TOKEN, end)
    return cache.commit(prompt, kv=kv, head=SizedSnapshot(SNAP)), kv


def lend(cache: LineageCache, entry: Entry) -> Loan:
    """Lend ``entry``'s rows as a lookup does: the cache's receipt, then the buffer."""
    loan = cache.lend(RestorePlan(entry.length, "entry", entry=entry))
    assert loan is not None
    entry.kv.lent = True
    return loan


ENTRY_BYTES = 299 * KV_PER_TOKEN + SNAP  # a 300-token prompt's entry


def test_queued_writes_count_in_ram_used_and_a_stalled_writer_cannot_push_it_over():
    disk = QueuedDisk()
    cache = LineageCache(LineageConfig(ram_budget_bytes=int(2.5 * ENTRY_BYTES), periodic_stride=0),
                         disk=disk, clock=Clock())
    a = serve(cache, words(300, 300))[2]
    assert cache.flush() == 1  # the writer takes a's write, and stalls
    longer = serve(cache, words(300, 300) + words(20, 305))[2]  # absorbs a while it is in flight
    # a left RAM, but the writer still holds its arrays: counted in ram_used until it lands.
    budgets = cache.budgets()
    assert not cache.holds(a) and budgets["disk_queue_bytes"] == a.nbytes
    assert budgets["ram_used"] == cache.ram_bytes + a.nbytes
    c = serve(cache, words(300, 302))[2]
    # c does not fit: the commit does not wait for the writer, so the least recently used
    # entry, longer, finds no room in the queue and leaves RAM unwritten.
    budgets = cache.budgets()
    assert budgets["ram_used"] <= budgets["ram_limit"]
    assert cache.holds(c) and not cache.holds(longer)
    assert cache.stats["evicted_unwritten"] == 1
    disk.land()
    assert cache.budgets()["disk_queue_bytes"] == 0 and a.id in disk.files


def test_lent_entries_are_skipped_and_eviction_goes_on_over_the_others():
    cache = make(ram_budget_bytes=int(3.5 * ENTRY_BYTES), periodic_stride=0, guard_min_suffix=10_000)
    lent = []
    for i in range(2):  # the two least recently used entries are lent to running requests
        entry, _ = serve_lendable(cache, words(300, 320 + i))
        lend(cache, entry)
        lent.append(entry)
    others = [serve(cache, words(300, 322 + i))[2] for i in range(4)]
    assert all(cache.holds(e) for e in lent)
    assert cache.ram_bytes <= cache.config.ram_budget_bytes
    assert [cache.holds(e) for e in others] == [False, False, False, True]
    assert cache.stats["evictions"] == 3


def test_eviction_stops_only_when_nothing_evictable_is_left():
    cache = make(ram_budget_bytes=int(3.5 * ENTRY_BYTES), periodic_stride=0, guard_min_suffix=10_000)
    entries, loans = [], []
    for i in range(3):
        entry, _ = serve_lendable(cache, words(300, 330 + i))
        loans.append(lend(cache, entry))
        entries.append(entry)
    cache.config = LineageConfig(**{**vars(cache.config), "ram_budget_bytes": int(1.5 * ENTRY_BYTES)})
    _, _, newest = serve(cache, words(300, 333))
    assert newest is None  # the only evictable entry was the new one itself
    assert all(cache.holds(e) for e in entries)
    entries[1].kv.lent = False
    cache.end(loans[1])
    serve(cache, words(300, 334))
    assert not cache.holds(entries[1]) and cache.holds(entries[0]) and cache.holds(entries[2])
    assert cache.stats["evictions"] == 3


def test_the_anchor_cap_skips_lent_anchors():
    cache = make(anchor_max_entries=1, periodic_stride=0, guard_min_suffix=10_000)
    anchor, _ = serve_lendable(cache, words(300, 340))
    cache.pin(anchor.id)
    lend(cache, anchor)
    serve(cache, words(200, 341) + words(20, 342), anchor_len=200)  # a second anchor: over the cap
    anchors = [e for e in cache.entries() if e.is_anchor]
    # The lent one stays (its rows are in use); the cap takes the other, not nothing.
    assert anchors == [anchor]


def test_with_the_disk_cap_below_ram_idle_ticks_write_nothing_after_the_first_pass():
    disk = FakeDisk()
    clock = Clock()
    cache = LineageCache(LineageConfig(disk_max_bytes=int(1.5 * ENTRY_BYTES), disk_write_delay_s=0,
                                       periodic_stride=0, guard_min_suffix=10_000), disk=disk, clock=clock)
    entries = [serve(cache, words(300, 350 + i))[2] for i in range(4)]
    assert cache.tick() == 4  # the first pass writes every entry; the cap keeps the newest file
    assert cache.disk_bytes <= cache.config.disk_max_bytes
    writes = len(disk.written)
    for _ in range(5):
        assert cache.tick() == 0
    assert len(disk.written) == writes and cache.stats["disk_writes"] == writes
    # Nothing is lost: an entry whose file went for the cap is written when it leaves RAM.
    not_on_disk = [e for e in entries if e.id not in disk.files]
    assert not_on_disk and not any(e.dirty for e in entries)
    cache.config = LineageConfig(**{**vars(cache.config), "ram_budget_bytes": 3 * ENTRY_BYTES})
    serve(cache, words(300, 360))
    evicted = [e for e in entries if not cache.holds(e)]
    assert evicted and all(e.id in disk.written[writes:] for e in evicted if e in not_on_disk)


def test_a_file_larger_than_the_disk_cap_does_not_push_out_the_others():
    disk = FakeDisk()
    cache = LineageCache(LineageConfig(disk_max_bytes=int(1.5 * ENTRY_BYTES), periodic_stride=0,
                                       guard_min_suffix=10_000), disk=disk, clock=Clock())
    small = serve(cache, words(300, 370))[2]
    cache.flush()
    big = serve(cache, words(1000, 371))[2]
    cache.flush()
    assert small.id in disk.files and big.id not in disk.files
    assert not big.dirty and not big.on_disk


def test_a_rejected_disk_file_is_counted_with_its_reason():
    record = DiskRecord("bad", np.array(words(400, 380), np.int32), "", (), 10, 0.0)
    events = []
    cache = LineageCache(LineageConfig(), disk=FakeDisk([record]), clock=Clock(), on_event=events.append)
    assert cache.promote(record, None, reason="hash mismatch") is None
    assert cache.stats["disk_rejects"] == 1
    assert [(e.kind, e.entry_id, e.detail) for e in events] == [("disk_reject", "bad", "hash mismatch")]


def test_an_eviction_pass_makes_room_in_the_queue_with_entries_already_on_disk():
    from types import SimpleNamespace

    from server_patch.lineage.budget import plan_eviction

    dirty_old, clean, dirty_new, keep = (SimpleNamespace(name=n, nbytes=100) for n in ("d1", "c", "d2", "k"))
    order = [dirty_old, clean, dirty_new, keep]
    needs_write = lambda e: e.name.startswith("d")  # noqa: E731

    # 50 bytes over: the least recently used entry goes; the disk lacks it, so the entry on
    # disk is evicted too, to make room for its write in the queue. The newer dirty one stays.
    chosen = plan_eviction(order, 50, needs_write, keep)
    assert [e.name for e in chosen.victims] == ["d1", "c"] and [e.name for e in chosen.written] == ["d1"]
    # Lossless (the first pass of a commit): no extra eviction, the victim is written.
    chosen = plan_eviction(order, 50, needs_write, keep, lossless=True)
    assert [e.name for e in chosen.victims] == ["d1"] and [e.name for e in chosen.written] == ["d1"]
    # No entry on disk left to evict: the dirty victim leaves RAM unwritten (never the budget).
    chosen = plan_eviction([dirty_old, dirty_new, keep], 50, needs_write, keep)
    assert [e.name for e in chosen.victims] == ["d1"] and chosen.written == []
    # Never ``keep`` to make room, even when it is the only entry on disk.
    chosen = plan_eviction([dirty_old, keep], 50, lambda e: e is dirty_old, keep)
    assert [e.name for e in chosen.victims] == ["d1"] and chosen.written == []


def test_hit_summary_counts_requests_by_how_they_started() -> None:
    from server_patch.lineage.summary import hit_summary

    summary = hit_summary({"hits_cold": 1, "hits_entry": 2, "hits_anchor": 1, "reused_tokens": 300,
                           "prefill_tokens": 100, "lookups": 9})
    assert summary["requests"] == 4 and summary["hits"] == 3 and summary["hit_rate"] == 0.75
    assert summary["by_kind"] == {"cold": 1, "entry": 2, "anchor": 1}
    assert summary["token_hit_rate"] == 0.75
    empty = hit_summary({})
    assert empty["requests"] == 0 and empty["hit_rate"] is None and empty["token_hit_rate"] is None
