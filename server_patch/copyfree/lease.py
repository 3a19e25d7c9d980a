"""Lending a stored entry's KV buffer to the lone request that extends it.

An entry adopted at the end of a conversation's previous turn holds that request's whole
buffer, spare rows included (``state.rows``). The next turn restores at the entry's head and
only appends: rows [0, L) are never written again. So instead of copying the entry into a
new batch buffer, the entry *lends* the buffer: it drops every reference (``MlxKV.lend``),
the restored row cache and then the batch cache become its only holders, and the prefill
writes rows L.. in place. MLX writes a slice update in place only when nothing else
references the buffer and copies otherwise, so a reference taken during the loan costs a
copy, never correctness.

A loan ends in one of two ways:

* the borrower commits its own entry, which absorbs the lent one: the buffer now belongs to
  the new entry and nothing is given back (``settled``);
* the borrower leaves without that (cancelled, joined a multi-row batch, failed), or another
  request needs the lent rows (a parallel restore, a branch from an earlier checkpoint):
  references to rows [0, L) are read back from whichever cache holds the buffer now
  (``give_back``). If the buffer is no longer where a lone row keeps it, the entry is
  dropped: a cold prefill later, never garbage.

``LeaseBook`` keeps the loans in force, by the borrowing request's key, and ends them.
Everything here runs on the generation thread, which is the only one that writes caches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional, Sequence

from server_patch.state.layout import CacheLayout, MlxKV

log = logging.getLogger("server_patch.copyfree")
# Where a loan's end is told: the lineage log, with the commits (operators and tests read it).
events = logging.getLogger("server_patch.lineage")


@dataclass
class Lease:
    """One entry's KV buffers, lent to one request."""

    entry: Any  # the policy's Entry; ``entry.kv`` is the lent ``MlxKV``
    key: Any  # the borrowing prompt's key (its uid comes later, from ``bind_rows``)
    holder: list[Any]  # per-layer caches that hold the buffers now
    uid: Any = None
    merged: bool = False  # the batch cache was built around the buffers (not a copy of them)

    @property
    def kv(self) -> MlxKV:
        return self.entry.kv


def has_room(kv: Any, rows_needed: int) -> bool:
    """Whether ``kv`` is a buffer in hand (not lent) with ``rows_needed`` rows of room."""
    return isinstance(kv, MlxKV) and not kv.lent and kv.capacity("keys") >= rows_needed


def lendable(kv: Any, length: int, rows_needed: int) -> bool:
    """Whether ``kv`` (an entry of ``length`` tokens) can be lent to a request that needs
    ``rows_needed`` rows: every KV buffer must already have that much room."""
    return has_room(kv, rows_needed) and kv.length == length


def lend(layout: CacheLayout, kv: MlxKV, snapshot: Any, length: int) -> list[Any]:
    """Restored row caches around ``kv``'s own buffers; the entry keeps no reference."""
    taken = kv.lend()
    try:
        return layout.build_lent(kv, taken, snapshot, length)
    except Exception:
        kv.give_back(taken)
        raise


def give_back(layout: CacheLayout, lease: Lease, caches: Sequence[Any] | None = None,
              *, still_stored: Callable[[Any], bool]) -> bool:
    """End ``lease``: the entry takes references to its rows from ``caches`` (default: the
    lease's holder). Returns False if the entry had to be dropped."""
    if not lease.kv.lent:
        return True
    if not still_stored(lease.entry):
        return True  # absorbed or evicted: nobody will read these rows through it
    try:
        lease.kv.give_back(layout.lent_rows(list(caches if caches is not None else lease.holder),
                                            lease.kv.length))
        return True
    except Exception as exc:
        log.warning("apc_copyfree lent rows of entry %s could not be taken back (%s): entry dropped",
                    getattr(lease.entry, "id", "?"), exc)
        return False


class LeaseBook:
    """The loans in force, by the borrowing request's key, over one cache and its layout.
    Ending a loan gives the rows back to the entry, or drops the entry if they are gone."""

    def __init__(self, layout: CacheLayout, cache: Any) -> None:
        self._layout, self._cache = layout, cache
        self._loans: dict[Any, Lease] = {}

    def __len__(self) -> int:
        return len(self._loans)

    def __contains__(self, key: Any) -> bool:
        return key in self._loans

    def get(self, key: Any) -> Optional[Lease]:
        return self._loans.get(key)

    def lend(self, key: Any, entry: Any, snapshot: Any, length: int) -> list[Any]:
        """Restored row caches around ``entry``'s own buffers, lent to request ``key``."""
        warm = lend(self._layout, entry.kv, snapshot, length)
        self._loans[key] = Lease(entry, key, list(warm))
        return warm

    def bind(self, key: Any, uid: Any) -> None:
        """The borrower's generator uid, once its batch is built."""
        lease = self._loans.get(key)
        if lease is not None and lease.uid is None:
            lease.uid = uid

    def end(self, lease: Lease, caches: Optional[Sequence[Any]] = None, *, reason: str) -> bool:
        """Give the lent rows back to their entry (or drop the entry if they are gone)."""
        self._loans.pop(lease.key, None)
        kept = give_back(self._layout, lease, caches, still_stored=self._cache.holds)
        if not kept:
            self._cache.drop(lease.entry.id, "lent rows lost")
        events.info("apc_copyfree loan of entry %s ended: %s%s", lease.entry.id, reason,
                    "" if kept else " (entry dropped)")
        return kept

    def end_of(self, uid: Any, caches: Optional[Sequence[Any]], *, reason: str) -> None:
        """End the loans of borrower ``uid`` (``caches``: where its buffers are now)."""
        if uid is None:
            return
        for lease in [lease for lease in self._loans.values() if lease.uid == uid]:
            self.end(lease, caches, reason=reason)

    def sweep(self, entry: Any, reclaimed: set[str], active: Optional[Iterable[Any]]) -> bool:
        """Before a lookup builds anything: end the loan of ``entry`` (the rows this prompt
        needs; its id goes into ``reclaimed``), loans whose borrower is not ``active`` any
        more, and loans never merged (their batch was not a lone row). True if an entry had
        to be dropped."""
        alive = set(active) if active is not None else None
        dropped = False
        for lease in list(self._loans.values()):
            if entry is lease.entry:
                reason = "shared"
                reclaimed.add(lease.entry.id)
            elif not lease.merged:
                reason = "unmerged"
            elif alive is not None and lease.uid is not None and lease.uid not in alive:
                reason = "orphan"
            else:
                continue
            dropped = not self.end(lease, reason=reason) or dropped
        return dropped

    def settle(self) -> None:
        """Loans whose entry was absorbed (by the borrower's own entry) or evicted are over:
        the buffer belongs to whoever writes it now."""
        for lease in list(self._loans.values()):
            if not self._cache.holds(lease.entry):
                del self._loans[lease.key]
                events.info("apc_copyfree loan of entry %s ended: absorbed", lease.entry.id)


__all__ = ["Lease", "LeaseBook", "give_back", "has_room", "lend", "lendable"]
