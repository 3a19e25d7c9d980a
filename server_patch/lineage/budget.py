"""What the RAM budget counts, and which entries one budget pass evicts.

The budget bounds everything the cache keeps alive: the entries in RAM *and* what the disk
writer still holds in its queue of entries that left RAM (evicted, absorbed or dropped while
their write was in flight). The writer holds the same arrays, so an entry both in RAM and
queued is counted once.

Evicting an entry the disk lacks frees nothing at once: its arrays move to the write queue
until the file is written. A commit or a disk promotion never waits for the writer: it runs on
the generation thread, and every decoding stream would wait with it (issue 29 measured 10 s
under a slow disk). So when a new entry does not fit, a tier whose writes land at once (the
simulator's) has every entry pushed out written (``lossless``); with the real store, whose
writer runs in the background (``writes_in_background``), the pass frees RAM now: entries
already on disk go first where that makes room in the queue for a write, and an entry still
without room leaves RAM unwritten (the least recently used first, the new entry itself last;
counted as ``evicted_unwritten``): later requests restore from an older file or prefill cold,
never from a wrong state. Lent entries (their rows belong to a running request) and entries
whose write is in flight (evicting them frees nothing until the write lands) are never evicted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Container, Optional, Sequence

from server_patch.lineage.holds import WRITE, WRITES_OWNER, Holds
from server_patch.lineage.model import Entry


class WriteQueue:
    """What the disk writer holds: the cache's holds of kind ``WRITE`` (``lineage.holds``),
    owned by the writer, one per queued write (its bytes: the entry's when queued)."""

    def __init__(self, holds: Optional[Holds] = None) -> None:
        self._holds = holds if holds is not None else Holds()

    def add(self, entry_id: str, nbytes: int) -> None:
        self._holds.take(WRITES_OWNER, entry_id, nbytes, resident=False, kind=WRITE)

    def done(self, entry_id: str) -> None:
        self._holds.written(entry_id)

    def holds(self, entry_id: str) -> bool:
        return self._holds.writing(entry_id)

    def bytes_outside(self, in_ram: Container[str]) -> int:
        """Queued bytes of entries RAM no longer counts."""
        return self._holds.writes_outside(in_ram)


@dataclass
class EvictionPass:
    """The entries one pass evicts (in order), and those of them that are written first."""

    victims: list[Entry]
    written: list[Entry]


def plan_eviction(order: Sequence[Entry], excess: int, needs_write: Callable[[Entry], bool],
                  keep: Entry | None = None, *, lossless: bool = False,
                  size: Callable[[Entry], int] = lambda entry: entry.nbytes) -> EvictionPass:
    """Evict from ``order`` (evictable entries, first victim first) until ``excess`` bytes
    have left RAM. ``lossless``: every victim the disk lacks is written (its bytes then stay
    in the queue until it lands). Otherwise such a victim is written only where the slack, or further
    entries already on disk (never ``keep``), make room for it in the queue; else dropped.
    ``size``: an entry's bytes (the cache passes its running count, ``tally``)."""
    victims: list[Entry] = []
    for entry in order:
        if excess <= 0:
            break
        victims.append(entry)
        excess -= size(entry)
    if lossless:
        return EvictionPass(victims, [e for e in victims if needs_write(e)])
    room = max(0, -excess)  # slack below the budget once every victim has left memory
    chosen = {id(e) for e in victims}
    spare = [e for e in order if id(e) not in chosen and e is not keep and not needs_write(e)]
    spare_bytes = sum(size(e) for e in spare)
    written: list[Entry] = []
    for entry in list(victims):
        if not needs_write(entry):
            continue
        if room + spare_bytes < size(entry):
            continue  # no room even with every on-disk entry gone: dropped unwritten
        while room < size(entry):
            extra = spare.pop(0)
            victims.append(extra)
            room += size(extra)
            spare_bytes -= size(extra)
        room -= size(entry)
        written.append(entry)
    return EvictionPass(victims, written)


__all__ = ["EvictionPass", "WriteQueue", "plan_eviction"]
