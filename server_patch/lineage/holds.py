"""What requests hold of the cache: one count per entry, checked in one place for eviction.

A request waiting in mlx-vlm's queue for its restore point's disk file (``integration.loading``)
holds that entry from the moment its load may start until its lookup admits it (or it leaves
the queue): the hold is taken before the load starts and reserves the file's bytes in the RAM
budget while it loads (a load in flight is counted, ``LineageCache.ram_used``); once the file is
promoted into RAM the hold pins the entry, which no other load, commit or promotion may evict
(``LineageCache._evictable`` is the one check). Loads beyond what the budget can hold wait their
turn (``LineageCache.hold`` answers False); the first hold is always granted, so a request whose
entry alone fits the budget always restores (issue 34 item 5: 8 concurrent continuations'
promotions evicted each other before admission, 6 of them then prefilled cold).

A staged copy of an entry's rows made for a queued request (``integration.staging``) is
reserved the same way (``LineageCache.reserve``, a key of its own, never pinned): its bytes count
in the RAM budget until the lookup takes it, so nothing loaded or staged for a waiting request
sits outside the budget.

Everything an owner holds is let go at once, ``LineageCache.release(owner)``. The owner is
whatever names the request (its row). This is the ownership primitive issue 35 asks for; loans
(``Loan``), loan receipts, staged receipts and deferrals still have their own counts (see
docs/architecture.md for what is left to move onto it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable


@dataclass(eq=False)
class Hold:
    """One owner's hold on one entry (by id): its bytes reserved while not in RAM."""

    owner: Hashable
    entry_id: str
    nbytes: int  # the file's bytes, counted as reserved until the entry is in RAM
    resident: bool = False  # the entry is in RAM now: counted as an entry, pinned


class Holds:
    """The holds of one cache, by owner and by entry. Not thread-safe: the cache's lock guards it."""

    def __init__(self) -> None:
        self._by_owner: dict[Hashable, list[Hold]] = {}
        self._by_entry: dict[str, list[Hold]] = {}

    def __len__(self) -> int:
        return sum(len(h) for h in self._by_owner.values())

    def take(self, owner: Hashable, entry_id: str, nbytes: int, *, resident: bool) -> Hold:
        """``owner`` holds ``entry_id`` (once: a second take of the same pair is the first)."""
        mine = self._by_owner.setdefault(owner, [])
        found = next((h for h in mine if h.entry_id == entry_id), None)
        if found is not None:
            return found
        hold = Hold(owner, entry_id, int(nbytes), resident)
        mine.append(hold)
        self._by_entry.setdefault(entry_id, []).append(hold)
        return hold

    def held(self, entry_id: str) -> bool:
        return bool(self._by_entry.get(entry_id))

    def of(self, owner: Hashable) -> list[Hold]:
        return list(self._by_owner.get(owner, ()))

    def settle(self, entry_id: str) -> None:
        """``entry_id`` is in RAM now: its holds pin it (its bytes are the entry's)."""
        for hold in self._by_entry.get(entry_id, ()):
            hold.resident = True

    def unsettle(self, entry_id: str) -> None:
        """``entry_id`` left RAM anyway (an operator's evict, a reset): reserved again."""
        for hold in self._by_entry.get(entry_id, ()):
            hold.resident = False

    def release(self, owner: Hashable) -> list[Hold]:
        """Everything ``owner`` holds, let go."""
        mine = self._by_owner.pop(owner, [])
        for hold in mine:
            left = [h for h in self._by_entry.get(hold.entry_id, ()) if h is not hold]
            if left:
                self._by_entry[hold.entry_id] = left
            else:
                self._by_entry.pop(hold.entry_id, None)
        return mine

    def reserved(self) -> int:
        """Bytes of held entries not in RAM (loads in flight, or loaded and not promoted)."""
        return sum(max(h.nbytes for h in holds) for holds in self._by_entry.values()
                   if not any(h.resident for h in holds))

    def pinned(self, size: Callable[[str], int]) -> int:
        """Bytes of held entries in RAM (``size``: an entry's counted bytes)."""
        return sum(size(entry_id) for entry_id, holds in self._by_entry.items() if any(h.resident for h in holds))

    def resident_ids(self) -> list[str]:
        return [entry_id for entry_id, holds in self._by_entry.items() if any(h.resident for h in holds)]

    def owners(self) -> list[Any]:
        return list(self._by_owner)


__all__ = ["Hold", "Holds"]
