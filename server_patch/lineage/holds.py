"""What requests hold of the cache: one record per hold, checked in one place.

A hold is taken by an owner (whatever names the request: its row, or a piece of work the row
owns: its staged copy) on one entry, and is of one kind:

* ``LOAD``: a request waiting in mlx-vlm's queue for its restore point's disk file
  (``integration.loading``) holds that entry from the moment its load may start until its
  lookup admits it (or it leaves the queue). The hold reserves the file's bytes in the RAM
  budget while it loads (``LineageCache.ram_used``); once the file is promoted into RAM the
  hold pins the entry, which no other load, commit or promotion may evict. Loads beyond what
  the budget can hold wait their turn (``LineageCache.hold`` answers False); the first is
  always granted, so a request whose entry alone fits the budget always restores (issue 34
  item 5: 8 concurrent continuations' promotions evicted each other before admission).
* ``RESERVED``: bytes outside the entries that a request holds (a staged copy of an entry's
  rows, ``integration.staging``; ``LineageCache.reserve``, a key of its own, never pinned):
  counted in the RAM budget until the lookup takes the copy.
* ``LENT``: an entry's KV rows are out to a request (a lone row's loan, ``copyfree.lease``;
  the stager thread reading them, ``integration.staging``; a reply appended into the buffer,
  ``copyfree.append``). The hold *is* the loan's receipt (``Loan``, ``LineageCache.lend``):
  while one is out the entry is not evictable, writable, rewindable nor lent again (the
  entry's ``loans`` mirrors the count for its readers). It names the entry object, not its
  id: a loan outlives an entry its borrower's own commit absorbed.
* ``WRITE``: the disk writer (``WRITES_OWNER``) holds an entry's state from its write's queueing
  until it lands, one hold per queued write (``budget.WriteQueue`` is its view): the entry is
  not evicted (that would free nothing) nor lent, and once it left RAM its bytes stay counted
  in the RAM budget until the write lands.
* ``BASE``: a decoding request holds the entry its own commit will extend in place (its reply
  appended into the buffer's spare rows, ``copyfree.append``: its prompt-end entry, or the entry
  a deferred row sharing its batch restored at the head of), from its prompt end until it
  commits or ends (``LineageCache.base``). The entry is not rewound, and under RAM pressure it
  leaves RAM only after every conversation entry nobody holds (decision 0013, amended: the
  budget stays a bound); when it leaves (pressure, an operator's evict, a reset) the holder
  copies.
* ``DEFERRED``: a lone row's own buffer, deferred to be adopted at its prompt end once nothing
  writes it (``copyfree.deferred``, ``LineageCache.defer``): no entry yet, so nothing pinned and
  nothing counted in the RAM budget (it is mlx-vlm's batch memory while the row decodes, the
  entry's from its commit on); let go by that commit or the row's end.

What each kind forbids of its entry is one table, ``FORBIDS``, asked in one place,
``Holds.forbids`` (the cache's ``_allows``: eviction, rewind, writing, lending; a loan's hold
names the entry object, so ``Entry.lent`` answers for ``LENT``). Everything an owner holds is let
go at once, ``LineageCache.release(owner)`` (``kinds`` to let go of some only: a request's
admission lets go of its load and its reservation, its loan lives on; a commit lets go of its
base and its deferral); one hold at once by ``LineageCache.end``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Collection, Container, Hashable, Optional

from server_patch.lineage.model import Loan

LOAD = "load"  # a restore point loading, then loaded and waiting for the admission: reserved, then pinned
RESERVED = "reserved"  # bytes outside the entries (a staged copy): reserved, never pinned
LENT = "lent"  # the entry's KV rows out to a request: a loan's receipt
WRITE = "write"  # the disk writer holds the entry's state until its write lands
BASE = "base"  # the entry a decoding request's own commit extends in place: evicted last until it commits
DEFERRED = "deferred"  # a lone row's own buffer, adopted at its commit: no entry yet, nothing counted
KINDS = (LOAD, RESERVED, LENT, WRITE, BASE, DEFERRED)
WRITES_OWNER = "disk writer"  # the owner of every WRITE hold (a label: the writer itself is the runtime's)

# What may be done to an entry: the cache's verbs a hold may forbid.
EVICT = "evict"  # leave RAM for the budget (an operator's evict and a reset are not asked)
REWIND = "rewind"  # move the head back to the protected prompt end
WRITING = "write"  # queue a write of its state
LENDING = "lend"  # lend its buffer to a request
FORBIDS: dict[str, frozenset[str]] = {  # the one table: what a hold of each kind forbids of its entry
    LOAD: frozenset({EVICT}),  # once resident (promoted)
    RESERVED: frozenset(),
    LENT: frozenset({EVICT, REWIND, WRITING, LENDING}),
    WRITE: frozenset({EVICT, LENDING}),
    BASE: frozenset({REWIND}),  # not EVICT: the RAM budget stays a bound (decision 0013, amended)
    DEFERRED: frozenset(),
}


@dataclass(eq=False)
class Hold:
    """One owner's hold on one entry (by id)."""

    owner: Hashable
    entry_id: str
    nbytes: int  # LOAD, RESERVED: the bytes counted as reserved until the entry is in RAM
    resident: bool = False  # LOAD: the entry is in RAM now, counted as an entry, pinned
    kind: str = LOAD
    loan: Optional[Loan] = None  # LENT: the receipt the borrower holds


class Holds:
    """The holds of one cache, by owner and (the budget's: LOAD, RESERVED) by entry. Not
    thread-safe: the cache's lock guards it."""

    def __init__(self) -> None:
        self._by_owner: dict[Hashable, list[Hold]] = {}
        self._by_entry: dict[str, list[Hold]] = {}  # LOAD and RESERVED holds only
        self._writes: dict[str, list[Hold]] = {}  # WRITE holds, one per queued write
        self._bases: dict[str, list[Hold]] = {}  # BASE holds, by the entry they keep

    def __len__(self) -> int:
        """The budget's holds (LOAD, RESERVED): what ``LineageCache.hold`` weighs."""
        return sum(len(h) for h in self._by_entry.values())

    def take(self, owner: Hashable, entry_id: str, nbytes: int, *, resident: bool, kind: str = LOAD,
             loan: Optional[Loan] = None) -> Hold:
        """``owner`` holds ``entry_id`` (a second take of the same owner, entry and kind is the
        first; a loan's receipt is a hold of its own each)."""
        mine = self._by_owner.setdefault(owner, [])
        found = next((h for h in mine if h.entry_id == entry_id and h.kind == kind and h.loan is loan), None)
        if found is not None and kind != WRITE:
            return found
        hold = Hold(owner, entry_id, int(nbytes), resident, kind, loan)
        mine.append(hold)
        index = self._index(kind)
        if index is not None:
            index.setdefault(entry_id, []).append(hold)
        return hold

    def _index(self, kind: str) -> Optional[dict[str, list[Hold]]]:
        """Where holds of ``kind`` are found by entry (None: by owner only, as a loan's receipt
        names its entry object and a deferral names no entry)."""
        return {LOAD: self._by_entry, RESERVED: self._by_entry, WRITE: self._writes,
                BASE: self._bases}.get(kind)

    def held(self, entry_id: str) -> bool:
        """A request's load holds ``entry_id`` (or a reservation names it)."""
        return bool(self._by_entry.get(entry_id))

    def writing(self, entry_id: str) -> bool:
        """A write of ``entry_id`` is queued (the writer holds its state)."""
        return bool(self._writes.get(entry_id))

    def based(self, entry_id: str) -> bool:
        """A decoding request's commit will extend ``entry_id`` in place (a ``BASE`` hold)."""
        return bool(self._bases.get(entry_id))

    def forbids(self, entry_id: str, verb: str) -> bool:
        """Whether a hold on ``entry_id`` forbids ``verb`` (``FORBIDS``; a lent entry's loan is
        asked through ``Entry.lent``, the cache's ``_allows``): the one check."""
        return ((self.held(entry_id) and verb in FORBIDS[LOAD]) or (self.writing(entry_id) and verb in FORBIDS[WRITE])
                or (self.based(entry_id) and verb in FORBIDS[BASE]))

    def pins(self, entry_id: str) -> bool:
        """Whether a hold keeps ``entry_id`` in RAM: a request's load or a queued write (a lent
        entry is pinned by its ``Entry.lent``: the loan names the object; a decoding request's
        base is evicted last, not pinned: ``LineageCache._eviction_order``)."""
        return self.forbids(entry_id, EVICT)

    def written(self, entry_id: str) -> None:
        """One queued write of ``entry_id`` landed (or failed): its hold is let go."""
        writes = self._writes.get(entry_id)
        if writes:
            self.drop(writes[0])

    def writes_outside(self, in_ram: Container[str]) -> int:
        """Bytes the writer holds of entries RAM no longer counts (the largest write of each)."""
        return sum(max(h.nbytes for h in holds) for entry_id, holds in self._writes.items() if entry_id not in in_ram)

    def of(self, owner: Hashable) -> list[Hold]:
        return list(self._by_owner.get(owner, ()))

    def loans(self) -> list[Loan]:
        """Every loan receipt out."""
        return [h.loan for holds in self._by_owner.values() for h in holds if h.loan is not None]

    def of_loan(self, loan: Loan) -> Optional[Hold]:
        return next((h for h in self._by_owner.get(loan.owner, ()) if h.loan is loan), None)

    def own(self, hold: Hold, owner: Hashable) -> None:
        """``hold`` is ``owner``'s from now on (a loan taken before its request's row was named)."""
        if hold.owner == owner:
            return
        self._detach(hold)
        hold.owner = owner
        if hold.loan is not None:
            hold.loan.owner = owner
        self._by_owner.setdefault(owner, []).append(hold)

    def settle(self, entry_id: str) -> None:
        """``entry_id`` is in RAM now: its holds pin it (its bytes are the entry's)."""
        for hold in self._by_entry.get(entry_id, ()):
            hold.resident = True

    def unsettle(self, entry_id: str) -> None:
        """``entry_id`` left RAM anyway (an operator's evict, a reset): reserved again."""
        for hold in self._by_entry.get(entry_id, ()):
            hold.resident = False

    def release(self, owner: Hashable, kinds: Optional[Collection[str]] = None) -> list[Hold]:
        """What ``owner`` holds (of ``kinds``; default: everything), let go."""
        mine = self._by_owner.pop(owner, [])
        let_go = [h for h in mine if kinds is None or h.kind in kinds]
        kept = [h for h in mine if h not in let_go]
        if kept:
            self._by_owner[owner] = kept
        for hold in let_go:
            self._unindex(hold)
        return let_go

    def drop(self, hold: Hold) -> None:
        """One hold let go (a loan's receipt returned)."""
        self._detach(hold)
        self._unindex(hold)

    def _detach(self, hold: Hold) -> None:
        """``hold`` out of its owner's list (the owner forgotten when it held nothing else)."""
        mine = [h for h in self._by_owner.get(hold.owner, ()) if h is not hold]
        if mine:
            self._by_owner[hold.owner] = mine
        else:
            self._by_owner.pop(hold.owner, None)

    def _unindex(self, hold: Hold) -> None:
        index = self._index(hold.kind)
        if index is None:
            return
        left = [h for h in index.get(hold.entry_id, ()) if h is not hold]
        if left:
            index[hold.entry_id] = left
        else:
            index.pop(hold.entry_id, None)

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


__all__ = ["BASE", "DEFERRED", "EVICT", "FORBIDS", "KINDS", "LENDING", "LENT", "LOAD", "RESERVED", "REWIND",
           "WRITE", "WRITES_OWNER", "WRITING", "Hold", "Holds"]
