"""The canary's default choices include disk files (server_patch.canary.points).

After a restart RAM is empty and every restore point is a file: ``apcctl verify`` with no
arguments (``every_kind``) and the schedule's ``sample`` must check those too, or state restored
from disk (a weights change the fingerprint missed, issue 23) would never be compared with cold.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from server_patch.canary import points as P
from server_patch.lineage import DISK, RAM
from server_patch.lineage.model import DiskRecord


@dataclass
class RamEntry:
    """What ``points`` reads of an entry: its id and restore points (length, kind, checkpoint)."""

    id: str
    length: int

    def restore_points(self):
        yield self.length, "entry", None


@dataclass
class Cache:
    ram: list[RamEntry] = field(default_factory=list)
    files: list[DiskRecord] = field(default_factory=list)

    def entries(self) -> list[RamEntry]:
        return list(self.ram)

    def records(self) -> list[DiskRecord]:
        return list(self.files)


def _record(record_id: str, length: int, checkpoints: tuple[tuple[int, str], ...] = ()) -> DiskRecord:
    return DiskRecord(id=record_id, tokens=np.arange(length, dtype=np.int32), namespace="0",
                      checkpoints=checkpoints, nbytes=1, last_used=0.0)


def test_after_a_restart_the_default_verify_and_the_schedule_check_files() -> None:
    cache = Cache(files=[_record("a", 40, ((16, "guard"),)), _record("b", 30)])
    chosen = P.every_kind(cache)
    assert [(p.entry_id, p.tier, p.kind) for p in chosen] == [("a", DISK, DISK)]
    sampled = {P.sample(cache, random.Random(seed)) for seed in range(20)}
    assert {p.tier for p in sampled} == {DISK} and {p.entry_id for p in sampled} == {"a", "b"}


def test_with_ram_entries_the_files_stay_a_kind_of_their_own() -> None:
    cache = Cache(ram=[RamEntry("r", 50)], files=[_record("r", 40), _record("f", 30)])
    assert {(p.kind, p.tier) for p in P.every_kind(cache)} == {("entry", RAM), (DISK, DISK)}
    kinds = [P.sample(cache, random.Random(seed)).kind for seed in range(40)]
    assert DISK in kinds and "entry" in kinds  # a kind at random: files are sampled as often as RAM
