"""The lineage policy's typed seams: its string enums, the KV handle protocol, the running byte
counts (always what re-summing every entry and file gives), and the names it gives stats keys
and environment variables."""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from server_patch.lineage import (
    ANCHOR, COLD, DISK, ENTRY, LOG_KINDS, RAM, RESTORE_KINDS, Checkpoint, DiskRecord, Entry,
    EventKind, KVAdmission, KVHandle, LineageCache, LineageConfig, Loan, Reason, RestoreKind,
    RestorePlan, SizedKV, SizedSnapshot, Tier,
)
from server_patch.lineage.flow import Admission
from server_patch.lineage.summary import hit_summary, hits_by_kind, hits_key, kv_by_mode, kv_key
from tests.lineage.test_lineage_policy import Clock, FakeDisk
from tests.lineage_checked import checked_lineage  # noqa: F401 (the fixture below)

pytestmark = pytest.mark.usefixtures("checked_lineage")  # check() after every cache verb

KV_PER_TOKEN = 10
SNAP = 300


# ----------------------------------------------------------------------------- enums

def test_the_enums_keep_the_strings_logs_stats_and_files_always_had():
    assert [str(k) for k in RESTORE_KINDS] == ["entry", "anchor", "guard", "final", "divergence",
                                                "periodic", "segment", "cold"]
    assert (COLD, ENTRY, ANCHOR, RAM, DISK) == ("cold", "entry", "anchor", "ram", "disk")
    assert COLD is RestoreKind.COLD and DISK is Tier.DISK and LOG_KINDS[-1] == "disk"
    assert [str(m) for m in KVAdmission] == ["lent", "copied", "staged"]
    assert json.dumps({"kind": ANCHOR, "tier": RAM, "why": Reason.RAM_BUDGET}) == \
        '{"kind": "anchor", "tier": "ram", "why": "ram budget"}'
    assert f"{DISK}:{RestoreKind.FINAL}" == "disk:final" and "%s" % EventKind.DISK_WRITE == "disk_write"
    assert RestoreKind("segment") is RestoreKind.SEGMENT  # a kind read back from a file


def test_events_and_stats_keys_carry_the_plain_values():
    events = []
    cache = LineageCache(LineageConfig(), clock=Clock(), on_event=events.append)
    prompt = list(range(100, 400))
    for turn in range(2):
        flow = Admission.admit(cache, prompt)
        flow.restored(KVAdmission.COPIED) if flow.plan.hit else flow.cold()
        flow.commit(kv=SizedKV(KV_PER_TOKEN, len(prompt) - 1), head=SizedSnapshot(SNAP))
        prompt = prompt + list(range(500 + turn * 50, 550 + turn * 50))
    cache.evict(cache.entries()[0].id)
    assert [e.kind for e in events] == ["store", "absorb", "store", "evict"]
    assert events[-1].detail == "operator" and type(json.loads(json.dumps(events[-1].kind))) is str
    assert {k: v for k, v in cache.stats.items() if k.startswith(("hits_", "kv_"))} == \
        {"hits_cold": 1, "hits_entry": 1, "kv_copied": 1}


def test_one_place_names_and_decodes_the_hits_and_kv_keys():
    stats = {hits_key(COLD): 3, hits_key(ENTRY): 2, hits_key(DISK): 1, kv_key(KVAdmission.LENT): 2,
             "reused_tokens": 10, "prefill_tokens": 30}
    assert hits_by_kind(stats) == {"cold": 3, "entry": 2, "disk": 1}
    assert hits_by_kind(stats, known=LOG_KINDS)["segment"] == 0
    assert kv_by_mode(stats) == {"lent": 2, "copied": 0, "staged": 0}
    summary = hit_summary(stats)
    assert (summary["requests"], summary["hits"], summary["token_hit_rate"]) == (6, 3, 0.25)


def test_the_settings_registry_and_from_env_use_one_naming_rule():
    from server_patch import settings as registry

    names = LineageConfig.env_names()
    assert names["enabled"] == "APC_LINEAGE" and names["ram_budget_bytes"] == "APC_LINEAGE_RAM_BUDGET_BYTES"
    listed = {s.name for s in registry.registry() if s.group == "lineage"}
    assert listed == set(names.values())
    config = LineageConfig.from_env({"APC_LINEAGE": "0", names["min_tokens"]: "32"})
    assert (config.enabled, config.min_tokens) == (False, 32)


# ----------------------------------------------------------------------------- handles

@dataclass
class LoanKV:
    """KV rows with spare room behind them that can be lent; a loan may end with the buffer
    grown (the borrower decoded past its room), as a real one can."""

    bytes_per_token: int
    length: int
    spare: int = 0
    lent: bool = False

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.length

    @property
    def held_nbytes(self) -> int:
        return self.bytes_per_token * (self.length + self.spare)

    def prefix(self, length: int) -> "LoanKV":
        return LoanKV(self.bytes_per_token, min(length, self.length))

    def truncated(self, length: int) -> "LoanKV":
        return LoanKV(self.bytes_per_token, length, self.length + self.spare - length)


def test_every_kv_handle_declares_its_loan_and_its_held_bytes():
    from server_patch.state.layout import MlxKV

    sized = SizedKV(KV_PER_TOKEN, 5)
    assert isinstance(sized, KVHandle) and isinstance(LoanKV(1, 5), KVHandle)
    assert (sized.lent, sized.held_nbytes) == (False, 50)
    mlx_kv = MlxKV([], 0)
    assert isinstance(mlx_kv, KVHandle) and (mlx_kv.lent, mlx_kv.held_nbytes) == (False, 0)
    entry = Entry("e", np.arange(5, dtype=np.int32), LoanKV(KV_PER_TOKEN, 5, spare=3), SizedSnapshot(SNAP),
                  "", 0.0, 0.0)
    assert entry.nbytes == 80 + SNAP and not entry.lent


# ----------------------------------------------------------------------------- running counts

def resummed(cache: LineageCache) -> dict[str, int]:
    """The budgets the cache reports, summed from scratch over every entry and file."""
    entries, records = cache.entries(), cache.records()
    anchors = [e for e in entries if e.is_anchor and e.pinned]
    return {"ram": sum(e.nbytes for e in entries), "anchor_bytes": sum(e.nbytes for e in anchors),
            "anchor_count": len(anchors), "conversation_bytes": sum(e.nbytes for e in entries if e not in anchors),
            "disk": sum(r.nbytes for r in records)}


def reported(cache: LineageCache) -> dict[str, int]:
    budgets = cache.budgets()
    return {"ram": cache.ram_bytes, "anchor_bytes": budgets["anchor_bytes"],
            "anchor_count": budgets["anchor_count"], "conversation_bytes": budgets["conversation_bytes"],
            "disk": cache.disk_bytes}


class Driver:
    """Applies one operation (by name, with two selectors) to a cache with a disk tier."""

    def __init__(self, rng: np.random.RandomState, **config: object) -> None:
        self.rng, self.clock = rng, Clock()
        self.cache = LineageCache(LineageConfig(**config), disk=FakeDisk(), clock=self.clock)
        self.seen: list[list[int]] = []  # every prompt, with its reply re-rendered
        self.loans: list[tuple[Loan, LoanKV]] = []

    def fresh(self, n: int) -> list[int]:
        return [int(x) for x in self.rng.randint(100, 5000, n)]

    def pick(self, items: list, i: int):
        return items[i % len(items)] if items else None

    def apply(self, op: str, a: int, b: int) -> None:
        cache = self.cache
        entry = self.pick(cache.entries(), a)
        if op == "serve":
            base = self.pick(self.seen, a) if b % 3 else None  # a next turn (or an edit) of one
            cut = b % 40 if b % 4 == 0 else 0
            prompt = (base[: max(2, len(base) - cut)] if base else self.fresh(8)) + self.fresh(20 + b % 60)
            self.serve(prompt, reply=self.fresh(b % 25) if b % 2 else None, anchor=8 if b % 5 == 0 else None)
        elif op == "rewind" and entry is not None:
            cache.rewind(entry)
        elif op == "pin" and entry is not None:
            cache.pin(entry.id)
        elif op == "unpin" and entry is not None:
            cache.unpin(entry.id)
        elif op == "flip_pin" and entry is not None:
            entry.pinned = not entry.pinned  # the admin's anchor prefill sets it from outside
        elif op == "evict":
            target = self.pick([*[e.id for e in cache.entries()], *[r.id for r in cache.records()]], a)
            if target is not None:
                cache.evict(target)
        elif op == "drop" and entry is not None:
            cache.drop(entry.id, "lent rows lost")
        elif op == "tick":
            self.clock.now += 60
            cache.tick()
        elif op == "flush":
            cache.flush()
        elif op == "promote":
            self.promote(self.pick(cache.records(), a))
        elif op == "lend" and entry is not None and isinstance(entry.kv, LoanKV):
            plan = RestorePlan(entry.length, ENTRY, RAM, entry, prompt_len=entry.length + 1)
            loan = cache.lend(plan)  # the receipt (refused while lent or queued for writing) ...
            if loan is not None:
                entry.kv.lent = True  # ... then what MlxKV.lend does, then the restore is counted
                cache.note_restore(plan, KVAdmission.LENT)
                self.loans.append((loan, entry.kv))
        elif op == "give_back" and self.loans:
            loan, kv = self.loans.pop(a % len(self.loans))
            kv.spare += 1 + b % 64  # the buffer came back grown
            kv.lent = False
            cache.end(loan)
        elif op == "clear":
            cache.clear()

    def serve(self, prompt: list[int], *, reply: list[int] | None, anchor: int | None) -> None:
        flow = Admission.admit(self.cache, prompt)
        flow.restored(KVAdmission.COPIED) if flow.plan.hit else flow.cold()
        captures = {c.length: (c.kind, SizedSnapshot(SNAP))
                    for c in flow.captures(anchor_len=anchor, segments=range(10, len(prompt), 17))}
        if reply:
            flow.commit_reply(reply, kv=LoanKV(KV_PER_TOKEN, len(prompt) + len(reply), spare=7),
                              head=SizedSnapshot(SNAP), prompt_head=SizedSnapshot(SNAP), captures=captures)
        else:
            flow.commit(kv=LoanKV(KV_PER_TOKEN, len(prompt) - 1, spare=3), head=SizedSnapshot(SNAP),
                        captures=captures)
        self.seen.append(prompt + (reply or []))

    def promote(self, record: DiskRecord | None) -> None:
        if record is None or self.cache.get(record.id) is not None:
            return
        entry = Entry(record.id, record.tokens.copy(), LoanKV(KV_PER_TOKEN, record.length),
                      SizedSnapshot(SNAP), record.namespace, 0.0, 0.0, is_anchor=record.is_anchor,
                      checkpoints=[Checkpoint(n, kind, SizedSnapshot(SNAP), created=0.0)
                                   for n, kind in record.checkpoints])
        self.cache.promote(record, entry)


OPS = ("serve", "serve", "serve", "rewind", "pin", "unpin", "flip_pin", "evict", "drop", "tick",
       "flush", "promote", "lend", "lend", "give_back", "give_back", "clear")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(steps=st.lists(st.sampled_from(OPS), min_size=1, max_size=60),
       budget=st.integers(2_000, 20_000), disk_cap=st.integers(2_000, 40_000), seed=st.integers(0, 10_000))
def test_the_running_counts_always_equal_the_resummed_bytes(steps, budget, disk_cap, seed):
    """Entries come and go, grow checkpoints, thin, rewind, are pinned, lent and given back
    grown, written, promoted, evicted and cleared: after every step the budgets the cache
    reports from its running counts are what summing every entry and file gives."""
    driver = Driver(np.random.RandomState(seed), ram_budget_bytes=budget, disk_max_bytes=disk_cap,
                    disk_write_delay_s=30, anchor_max_entries=2, max_checkpoints=3, min_tokens=4,
                    segment_min_gap=8, periodic_stride=64)
    picks = np.random.RandomState(seed + 1)  # which entry, how long a prompt: drawn, not shrunk to 0
    for op in steps:
        a, b = int(picks.randint(0, 50)), int(picks.randint(0, 200))
        driver.apply(op, a, b)
        assert reported(driver.cache) == resummed(driver.cache), (op, a, b)


def test_a_loan_that_ends_with_a_grown_buffer_is_counted_at_its_new_size():
    """The one change the policy does not make itself: the next read counts it."""
    driver = Driver(np.random.RandomState(7), min_tokens=4)
    driver.serve(driver.fresh(60), reply=None, anchor=None)
    driver.apply("lend", 0, 0)
    (entry,) = driver.cache.entries()
    before = driver.cache.ram_bytes
    driver.apply("give_back", 0, 20)
    assert not entry.lent and driver.cache.ram_bytes == before + 21 * KV_PER_TOKEN == entry.nbytes
