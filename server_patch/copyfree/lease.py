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

Everything here runs on the generation thread, which is the only one that writes caches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from server_patch.state.layout import CacheLayout, MlxKV

log = logging.getLogger("server_patch.copyfree")


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


def lendable(kv: Any, length: int, rows_needed: int) -> bool:
    """Whether ``kv`` (an entry of ``length`` tokens) can be lent to a request that needs
    ``rows_needed`` rows: every KV buffer must already have that much room."""
    return isinstance(kv, MlxKV) and not kv.lent and kv.length == length and \
        kv.capacity("keys") >= rows_needed


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


__all__ = ["Lease", "give_back", "lend", "lendable"]
