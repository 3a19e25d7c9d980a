"""The exact-mode baselines: stock 0.7.10 and the post's old build, rule by rule."""

from __future__ import annotations

import numpy as np

from apcctl.lab.sim.policies.exact import GIB, ExactSnapshotPolicy, Snapshot, SnapshotDisk
from apcctl.lab.sim.policies.base import Ledger
from apcctl.lab.sim.policies.post_baseline import make_post_baseline, post_store_points
from apcctl.lab.sim.policies.stock import make_stock, stock_store_points
from apcctl.lab.sim.sizes import load_sizes
from apcctl.lab.sim.trace import Request

TINY = load_sizes("tiny")


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(1000, 100_000, size=n, dtype=np.int32)


def req(tokens: np.ndarray, t: float = 0.0) -> Request:
    return Request(conv="c", t=t, tokens=tokens)


def ram_lengths(policy: ExactSnapshotPolicy) -> list[int]:
    return [s.length for s in policy.ram.entries.values()]


def test_store_points_guard_1_and_last_2048_multiple():
    assert stock_store_points(256, 0) == [(255, False)]
    assert stock_store_points(256, 255) == []  # identical resend stores nothing
    assert stock_store_points(2922, 0) == [(2048, True), (2921, False)]
    assert stock_store_points(2946, 2921) == [(2945, False)]  # warm, no boundary crossed
    assert stock_store_points(4200, 2921) == [(4096, True), (4199, False)]  # warm, crosses 4096
    assert stock_store_points(2049, 0) == [(2048, False)]  # the boundary *is* n - 1


def test_verified_tiny_model_sequence_256_tokens():
    """APC internals §2: turn1 stores 255; identical resend hits 255; extension stores 279."""
    stock, p = make_stock(TINY), prompt(280)
    assert stock.serve(req(p[:256])).reused == 0
    assert ram_lengths(stock) == [255]
    assert stock.serve(req(p[:256])).reused == 255
    assert ram_lengths(stock) == [255]
    assert stock.serve(req(p[:280])).reused == 255
    assert ram_lengths(stock) == [255, 279]


def test_verified_tiny_model_sequence_2922_tokens_and_2_entry_lru():
    stock, p = make_stock(TINY), prompt(2946)
    stock.serve(req(p[:2922]))
    assert ram_lengths(stock) == [2048, 2921]
    stock.serve(req(p))
    assert ram_lengths(stock) == [2921, 2945]  # 2048 fell out of the 2-entry LRU
    assert stock.ledger.evictions == 1
    assert len(stock.disk.files) == 3  # every snapshot also went to disk


def test_only_whole_stored_prefixes_match():
    stock, p = make_stock(TINY), prompt(500)
    stock.serve(req(p[:300]))
    edited = p[:400].copy()
    edited[250] += 1  # diverges inside the stored 299-token snapshot
    assert stock.serve(req(edited)).reused == 0


def test_disk_is_consulted_only_for_a_strictly_longer_match():
    stock = make_stock(TINY)
    a, b, c = prompt(300, 1), prompt(300, 2), prompt(300, 3)
    for i, p in enumerate((a, b, c)):
        stock.serve(req(p, t=i))
    assert ram_lengths(stock) == [299, 299]  # a was evicted from RAM, kept on disk
    served = stock.serve(req(np.concatenate([a, prompt(20, 9)]), t=10))
    assert (served.reused, served.source) == (299, "disk")
    assert stock.ledger.disk_bytes_read == TINY.full_snapshot_bytes(299)
    assert 299 in ram_lengths(stock) and len(stock.ram.entries) == 2  # promoted through a clone


def test_ram_match_blocks_an_equal_length_disk_match():
    stock = make_stock(TINY)
    b = prompt(300, 2)
    stock.serve(req(b))
    served = stock.serve(req(np.concatenate([b, prompt(20, 8)]), t=1))
    assert served.source == "ram" and stock.ledger.disk_bytes_read == 0


def test_snapshots_over_8_gib_skip_ram_and_go_straight_to_disk():
    full = load_sizes("full")
    stock = make_stock(full)
    stock.serve(req(prompt(12_000)))
    assert stock.ram.entries and max(ram_lengths(stock)) == 10_240  # the interval one fits
    assert stock.ledger.ram_skips == 1  # n - 1 = 11,999 tokens is > 8 GiB
    assert stock.ledger.bytes_cloned == full.full_snapshot_bytes(10_240)
    assert stock.ledger.disk_bytes_written == full.full_snapshot_bytes(10_240) + full.full_snapshot_bytes(11_999)


def test_disk_tier_evicts_by_mtime_to_90_percent():
    ledger, disk = Ledger(), SnapshotDisk(max_bytes=100, low_watermark=0.9)
    for i in range(4):
        disk.write(Snapshot(bytes([i]), prompt(1), 30, False), now=float(i), ledger=ledger)
    assert sorted(k[0] for k in disk.files) == [1, 2, 3]  # 120 > 100: oldest goes, 90 <= 90
    disk.touch(disk.files[bytes([1])], now=10.0)  # a load refreshes mtime
    disk.write(Snapshot(bytes([9]), prompt(1), 30, False), now=11.0, ledger=ledger)
    assert sorted(k[0] for k in disk.files) == [1, 3, 9]
    assert ledger.disk_evictions == 2 and ledger.disk_bytes_deleted == 60


def test_disk_writes_dedupe_by_tokens():
    ledger, disk = Ledger(), SnapshotDisk(max_bytes=20 * GIB)
    snap = Snapshot(b"k", prompt(1), 10, False)
    disk.write(snap, 0.0, ledger)
    disk.write(snap, 1.0, ledger)
    assert ledger.disk_bytes_written == 10


def test_post_baseline_guard_16_and_full_prompt_every_request():
    assert post_store_points(300, 0) == [(284, True), (300, False)]
    assert post_store_points(300, 299) == [(300, False)]
    post, p = make_post_baseline(TINY), prompt(300)
    post.serve(req(p))
    assert post.serve(req(p, t=1)).reused == 284  # the snapshot at n cannot serve a resend
    assert post.ledger.bytes_cloned == 2 * TINY.full_snapshot_bytes(300) + TINY.full_snapshot_bytes(284)
    assert post.ram.max_entries == 8 and post.ram.max_bytes is None
