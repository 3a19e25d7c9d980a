"""Whole-prompt snapshot caches: mlx-vlm's exact mode, parameterised by where it snapshots.

Both ``stock`` (0.7.10) and ``post-baseline`` (the post's older build) store full snapshots
(every cache of every layer, projected cache included) and match them only as a whole token
prefix of the request, leaving at least one token to compute (apc.py:371-392, 3350). The RAM
tier is an LRU with a count cap and an optional byte cap; every stored snapshot also goes to a
disk tier evicted by mtime down to a low watermark, which lookup consults only for a match
strictly longer than RAM's (apc.py:3328-3516). They differ only in ``store_points``.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from apcctl.lab.sim.policies.base import Ledger, Served
from apcctl.lab.sim.sizes import StateSizes
from apcctl.lab.sim.trace import Request
from server_patch.lineage.lookup import common_prefix_len
from server_patch.lineage.model import COLD, DISK, RAM

GIB = 1 << 30
MIN_TOKENS = 16  # APC_EXACT_MIN_TOKENS: shorter snapshots are never stored

# (length, secondary) pairs to snapshot for a prompt of n tokens restored at ``prefix``.
StorePoints = Callable[[int, int], list[tuple[int, bool]]]


@dataclass
class Snapshot:
    key: bytes
    tokens: np.ndarray
    nbytes: int
    secondary: bool  # an interval or guard snapshot rather than a prompt's own state
    mtime: float = 0.0
    seq: int = 0

    @property
    def length(self) -> int:
        return int(self.tokens.shape[0])


def match_len(prompt: np.ndarray, snap: Snapshot, limit: int) -> int:
    """The exact-mode rule: the whole stored prefix, and no longer than ``limit``."""
    if snap.length > limit:
        return 0
    return snap.length if common_prefix_len(prompt, snap.tokens) == snap.length else 0


@dataclass
class SnapshotDisk:
    """One file per snapshot; writes dedupe by token key; mtime-LRU eviction past the cap."""

    max_bytes: int
    low_watermark: float = 0.9
    files: dict[bytes, Snapshot] = field(default_factory=dict)
    _seq: itertools.count = field(default_factory=itertools.count)

    @property
    def held(self) -> int:
        return sum(s.nbytes for s in self.files.values())

    def best(self, prompt: np.ndarray, limit: int, longer_than: int) -> Snapshot | None:
        found, found_len = None, longer_than
        for snap in self.files.values():
            length = match_len(prompt, snap, limit)
            if length > found_len:
                found, found_len = snap, length
        return found

    def touch(self, snap: Snapshot, now: float) -> None:
        """Loads call os.utime, so a read refreshes the file's place in the LRU."""
        snap.mtime, snap.seq = now, next(self._seq)

    def write(self, snap: Snapshot, now: float, ledger: Ledger) -> None:
        if snap.key in self.files:
            return
        stored = Snapshot(snap.key, snap.tokens, snap.nbytes, snap.secondary, now, next(self._seq))
        self.files[snap.key] = stored
        ledger.disk_bytes_written += snap.nbytes
        held = self.held
        if held <= self.max_bytes:
            return
        target = self.max_bytes * self.low_watermark
        for victim in sorted(self.files.values(), key=lambda s: (s.mtime, s.seq)):
            if held <= target:
                break
            del self.files[victim.key]
            held -= victim.nbytes
            ledger.disk_bytes_deleted += victim.nbytes
            ledger.disk_evictions += 1


@dataclass
class SnapshotRam:
    """The RAM tier: an LRU ``OrderedDict`` with a count cap and an optional byte cap."""

    max_entries: int
    max_bytes: int | None
    entries: OrderedDict[bytes, Snapshot] = field(default_factory=OrderedDict)

    @property
    def held(self) -> int:
        return sum(s.nbytes for s in self.entries.values())

    def best(self, prompt: np.ndarray, limit: int) -> Snapshot | None:
        """Strictly longest match in LRU order (ties keep the older); the winner is touched."""
        found, found_len = None, 0
        for snap in self.entries.values():
            length = match_len(prompt, snap, limit)
            if length > found_len:
                found, found_len = snap, length
        if found is not None:
            self.entries.move_to_end(found.key)
        return found

    def fits(self, nbytes: int) -> bool:
        return self.max_entries > 0 and (self.max_bytes is None or nbytes <= self.max_bytes)

    def make_room(self, nbytes: int, ledger: Ledger) -> None:
        """``_make_room(size, retain_bytes=size)``: evict oldest until ``size`` fits the byte cap."""
        if self.max_bytes is None:
            return
        held = self.held
        while self.entries and held + nbytes > self.max_bytes:
            _, victim = self.entries.popitem(last=False)
            held -= victim.nbytes
            ledger.evictions += 1

    def insert(self, snap: Snapshot, ledger: Ledger, *, replace: bool = True) -> None:
        if snap.key in self.entries and not replace:
            return
        self.entries[snap.key] = snap
        self.entries.move_to_end(snap.key)
        while len(self.entries) > self.max_entries:
            self.entries.popitem(last=False)
            ledger.evictions += 1


class ExactSnapshotPolicy:
    """Exact mode with pluggable snapshot placement; see ``stock`` and ``post_baseline``."""

    def __init__(self, name: str, sizes: StateSizes, store_points: StorePoints, *,
                 ram_entries: int, ram_max_bytes: int | None, disk_max_bytes: int,
                 disk_low_watermark: float = 0.9) -> None:
        self.name = name
        self.sizes = sizes
        self.store_points = store_points
        self.ledger = Ledger()
        self.ram = SnapshotRam(ram_entries, ram_max_bytes)
        self.disk = SnapshotDisk(disk_max_bytes, disk_low_watermark)

    def serve(self, req: Request) -> Served:
        prompt, n, now = req.tokens, req.n, req.t
        limit = n - 1
        hit = self.ram.best(prompt, limit)
        prefix, source = (hit.length, RAM) if hit is not None else (0, COLD)
        if prefix < limit:
            found = self.disk.best(prompt, limit, longer_than=prefix)
            if found is not None:
                prefix, source = found.length, DISK
                self._load(found, now)
        for length, secondary in self.store_points(n, prefix):
            if MIN_TOKENS <= length and length > prefix:
                self._store(prompt[:length], secondary, now)
        return Served(prefix, source)

    def _load(self, snap: Snapshot, now: float) -> None:
        """A disk hit is read, touched, and promoted into RAM through one more clone."""
        self.ledger.disk_bytes_read += snap.nbytes
        self.disk.touch(snap, now)
        if self.ram.fits(snap.nbytes):
            self.ram.make_room(snap.nbytes, self.ledger)
            self.ledger.bytes_cloned += snap.nbytes
            self.ram.insert(Snapshot(snap.key, snap.tokens, snap.nbytes, snap.secondary),
                            self.ledger, replace=False)

    def _store(self, tokens: np.ndarray, secondary: bool, now: float) -> None:
        """``store_exact_cache``: clone into RAM if it fits, else straight to disk; disk always."""
        snap = Snapshot(tokens.tobytes(), tokens, self.sizes.full_snapshot_bytes(tokens.shape[0]),
                        secondary)
        if self.ram.fits(snap.nbytes):
            self.ram.make_room(snap.nbytes, self.ledger)
            self.ledger.bytes_cloned += snap.nbytes
            self.ram.insert(snap, self.ledger)
        else:
            self.ledger.ram_skips += 1  # serialised from the live cache, no clone
        self.disk.write(snap, now, self.ledger)

    def finish(self, end_time: float) -> None:
        """Every write already happened at store time."""

    def ram_bytes(self) -> int:
        return self.ram.held

    def disk_bytes(self) -> int:
        return self.disk.held

    def checkpoint_bytes(self) -> int:
        return sum(s.nbytes for s in self.ram.entries.values() if s.secondary)
