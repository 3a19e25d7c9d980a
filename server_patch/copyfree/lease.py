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

The loan itself is the cache's receipt (``LineageCache.lend``/``end``): while it is out the
entry is not evictable, writable nor rewindable, and the cache refuses a loan of an entry
queued for writing (the writer reads its rows). A request's loan is its row's ``loan``
(``integration.session``). Everything here runs on the generation thread, which is the only
one that writes caches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, TypeGuard, cast

from server_patch.lineage.model import Entry, Loan, Reason, RestorePlan
from server_patch.state.layout import CacheLayout, MlxKV, MlxSnapshot

if TYPE_CHECKING:
    from server_patch.lineage.policy import LineageCache

log = logging.getLogger("server_patch.copyfree")
# Where a loan's end is told: the lineage log, with the commits (operators and tests read it).
events = logging.getLogger("server_patch.lineage")


@dataclass
class Lease:
    """One entry's KV buffers, lent to one request under a receipt (``LineageCache.lend``)."""

    loan: Loan  # the cache's receipt: the entry is not evictable, writable nor rewindable meanwhile
    holder: list[Any]  # per-layer caches that hold the buffers now (mlx-vlm's, untyped)
    merged: bool = False  # the batch cache was built around the buffers (not a copy of them)

    @property
    def entry(self) -> Entry:
        return self.loan.entry

    @property
    def kv(self) -> MlxKV:
        return cast(MlxKV, self.entry.kv)  # only an MlxKV lends its buffers (``lend``)


def has_room(kv: object, rows_needed: int) -> TypeGuard[MlxKV]:
    """Whether ``kv`` is a buffer in hand (not lent) with ``rows_needed`` rows of room."""
    return isinstance(kv, MlxKV) and not kv.lent and kv.capacity("keys") >= rows_needed


def lendable(kv: object, length: int, rows_needed: int) -> bool:
    """Whether ``kv`` (an entry of ``length`` tokens) can be lent to a request that needs
    ``rows_needed`` rows: every KV buffer must already have that much room."""
    return has_room(kv, rows_needed) and kv.length == length


def lend(layout: CacheLayout, kv: MlxKV, snapshot: MlxSnapshot, length: int) -> list[Any]:
    """Restored row caches around ``kv``'s own buffers; the entry keeps no reference."""
    taken = kv.lend()
    try:
        return layout.build_lent(kv, taken, snapshot, length)
    except Exception:
        kv.give_back(taken)
        raise


def give_back(layout: CacheLayout, lease: Lease, caches: Sequence[Any] | None = None,
              *, still_stored: Callable[[Entry], bool]) -> bool:
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


def lend_entry(layout: CacheLayout, cache: LineageCache, plan: RestorePlan) -> Optional[Lease]:
    """Restored row caches around ``plan.entry``'s own buffers, under the cache's receipt;
    None if the cache refuses the loan (the entry is queued for writing, or lent already)."""
    loan = cache.lend(plan)
    if loan is None:
        return None
    try:
        # A lent plan has an entry (``LineageCache.lend``); the real cache stores MlxKV/MlxSnapshot.
        kv, state = cast(MlxKV, loan.entry.kv), cast(MlxSnapshot, plan.state)
        return Lease(loan, list(lend(layout, kv, state, plan.length)))
    except Exception:
        cache.end(loan)
        raise


def end(layout: CacheLayout, cache: LineageCache, lease: Lease, caches: Optional[Sequence[Any]] = None, *,
        reason: str) -> bool:
    """End ``lease``: the rows go back to their entry (or the entry is dropped if they are
    gone), and the receipt is returned. Returns False if the entry was dropped."""
    kept = give_back(layout, lease, caches, still_stored=cache.holds)
    cache.end(lease.loan)
    if not kept:
        cache.drop(lease.entry.id, Reason.LENT_ROWS_LOST)
    events.info("apc_copyfree loan of entry %s ended: %s%s", lease.entry.id, reason,
                "" if kept else " (entry dropped)")
    return kept


def absorbed(cache: LineageCache, lease: Lease) -> bool:
    """Whether the loan is over because its entry left the cache (the borrower's own entry
    absorbed it, or it was evicted): the buffer belongs to whoever writes it now. If so, the
    receipt is returned."""
    if cache.holds(lease.entry):
        return False
    cache.end(lease.loan)
    events.info("apc_copyfree loan of entry %s ended: absorbed", lease.entry.id)
    return True


__all__ = ["Lease", "absorbed", "end", "give_back", "has_room", "lend", "lend_entry", "lendable"]
