"""Which restore points a check covers: an entry's head, its checkpoints, an anchor, a disk file.

Points are chosen from the policy's own index (``LineageCache.entries`` / ``records``) and
carry only ids and lengths; the check resolves them again on the generation thread, so a point
whose entry went away meanwhile is skipped, never restored from a stale handle.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass
from typing import Any, Iterable

from server_patch.lineage import DISK, RAM, CacheError


@dataclass(frozen=True)
class Point:
    """One restore point: ``kind`` is what a request restoring it is logged as (``disk`` for a
    file), ``stored_kind`` what the point is inside its entry (entry, anchor, a checkpoint kind)."""

    entry_id: str
    length: int
    kind: str
    tier: str
    stored_kind: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _ram_points(entry: Any) -> list[Point]:
    return [Point(entry.id, length, kind, RAM, kind) for length, kind, _ in entry.restore_points()]


def _disk_points(record: Any, head_only: bool = False) -> list[Point]:
    points = [Point(record.id, length, DISK, DISK, kind) for length, kind in record.restore_points()]
    return points[:1] if head_only else points


def _points_of(entry: Any, record: Any) -> list[Point]:
    """In RAM: the head and checkpoints, plus the file's head when there is one (the file was
    written from an earlier state of the same entry); a file only on disk: all its points."""
    points = _ram_points(entry) if entry is not None else []
    if record is not None:
        points += _disk_points(record, head_only=entry is not None)
    return points


def of_entry(cache: Any, entry_id: str) -> list[Point]:
    """Every restore point of one entry, RAM and disk. Raises CacheError."""
    entry = cache.get(entry_id)
    record = next((r for r in cache.records() if r.id == entry_id), None)
    if entry is None and record is None:
        raise CacheError(entry_id)
    return _points_of(entry, record)


def all_points(cache: Any, count: int | None = None) -> list[Point]:
    """Every restore point of the ``count`` (default all) most recently used entries: RAM
    entries first, then files not in RAM."""
    records = {r.id: r for r in cache.records()}
    in_ram = cache.entries()
    chosen = [(e, records.pop(e.id, None)) for e in in_ram]
    chosen += [(None, r) for r in records.values()]
    return [p for entry, record in chosen[:count] for p in _points_of(entry, record)]


def recent(cache: Any, count: int) -> list[Point]:
    """Every point of the ``count`` most recently used entries."""
    return all_points(cache, count)


def every_kind(cache: Any) -> list[Point]:
    """One point of each restore kind present, the most recently used of its kind."""
    seen: dict[str, Point] = {}
    for point in all_points(cache):
        seen.setdefault(point.kind, point)
    return list(seen.values())


def sample(cache: Any, rng: random.Random) -> Point | None:
    """One point for the schedule: a kind at random, then a point of that kind at random, so a
    rare kind (a guard, a disk file) is checked as often as the common ones."""
    by_kind: dict[str, list[Point]] = {}
    for point in all_points(cache):
        by_kind.setdefault(point.kind, []).append(point)
    if not by_kind:
        return None
    kind = rng.choice(sorted(by_kind))
    return rng.choice(by_kind[kind])


def grouped(points: Iterable[Point]) -> dict[tuple[str, str], list[Point]]:
    """Points by (entry id, tier): one group is restored from one entry and checked against one
    cold pass over its tokens."""
    groups: dict[tuple[str, str], list[Point]] = {}
    for point in points:
        group = groups.setdefault((point.entry_id, point.tier), [])
        if all(p.length != point.length for p in group):
            group.append(point)
    return {key: sorted(group, key=lambda p: p.length) for key, group in groups.items()}

