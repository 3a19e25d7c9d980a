"""A shared row's reply commit, bounded: only the rows its entry lacks, into the entry's spare rows.

A row that shares a decoding batch cannot hand its buffer over when it ends (the batch's
buffer holds the other rows too), so its entry past the reply used to be a copy of the whole
row: prompt + reply, 265-368 ms at 16.4k tokens on the bench preset (issue 29). But rows
``[0, B)`` of that row are, bit for bit, an entry's already (its ``Base``): the prompt-end
entry its own commit stored (the buffer adopted at its join, or a lookup's copy), or, for a
row deferred in a shared prompt batch, the entry it restored at the head of (the merge copied
those rows). Where that entry's buffer has room (an adopted buffer keeps its spare rows, the
lone merge allocates ``APC_COPYFREE_LEND_HEADROOM``), the rows ``[B, L)`` are written into it
in place: at most the reply (``max_tokens`` rows) plus, for a deferred row, its prompt suffix.
The new entry absorbs the old one and owns the buffer, spare rows left, so the next turn is
still lent it.

From the row's prompt end to its commit the base entry is the row's hold of kind ``BASE``
(``LineageCache.base``, decision 0013): RAM pressure evicts other entries, and no rewind moves
its head. The buffer is taken under the cache's loan receipt (``LineageCache.lend``: refused
while the entry is lent, queued for writing or gone), so the disk writer never reads a
half-swapped handle and nothing evicts the entry meanwhile. After the store the receipt ends; if the old
entry is still held (the store kept an identical entry instead, or refused), the buffer goes
back to it, rows ``[0, B)`` untouched. Anything else (no base, no room, a quantized layer, a
buffer whose rows moved) is the whole-row copy, counted (``reply_row_copies``) so an operator sees it.

A row with no such entry gets one with room before it ends (``copy_with_room``): a cold row
of a shared prompt batch is copied out at its prefill end, and a deferred row a lookup
surfaces at that moment, each into buffers of ``reply_capacity`` rows: the prompt, the
request's ``max_tokens`` and the next turn's decode reserve and lend headroom, bounded by the
spare rows an adopted buffer may carry (``APC_COPYFREE_ADOPT_DEAD_MIN`` / ``_FRACTION``) and
rounded to the merge's size buckets. The RAM budget counts an entry by its buffers' bytes
(``MlxKV.held_nbytes``), so that room is counted from the prompt-end commit on, and it is not
trimmed when the reply ends shorter: trimming is the whole-row copy this avoids, and the rows
left are the room the next turn is lent.
Runs on the generation thread, the only one that writes caches.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional, Sequence

import mlx.core as mx

from server_patch.observe import ledger
from server_patch.copyfree import merge as copyfree_merge
from server_patch.copyfree.settings import CopyFreeSettings
from server_patch.lineage.model import Entry, Loan, RestoreKind, RestorePlan
from server_patch.state import rows
from server_patch.state.layout import CacheLayout, MlxKV
from server_patch.state.registry import Arrays, ref

if TYPE_CHECKING:
    from server_patch.integration.pending import Pending
    from server_patch.lineage.policy import LineageCache

log = logging.getLogger("server_patch.lineage")


@dataclass(frozen=True)
class Base:
    """An entry whose KV rows are row's rows ``[0, length)``, bit for bit, by its handle."""

    kv: object  # the entry's KV handle (``MlxKV``) when the row's rows were taken from or into it
    length: int


@dataclass
class Appended:
    """The new entry's KV (the base entry's buffer, rows appended) and the receipt it holds."""

    kv: MlxKV
    entry: Entry
    loan: Loan
    written: int  # KV bytes written into the buffer
    rows: int  # rows appended

    def finish(self, cache: LineageCache) -> None:
        """After the store: the receipt ends; the buffer goes back to the old entry if the new
        one did not absorb it (rows ``[0, B)`` are as they were)."""
        try:
            if cache.holds(self.entry) and self.entry.kv.lent:
                _mlx_kv(self.entry).give_back(_lent_part(self.kv.layers))
        finally:
            cache.end(self.loan)


def _mlx_kv(entry: Entry) -> MlxKV:
    """An entry's KV as the buffers it is: ``base_entry`` finds only entries whose handle is
    an ``MlxKV`` (the one handle ``Base`` names)."""
    assert isinstance(entry.kv, MlxKV)
    return entry.kv


def base_entry(cache: LineageCache, base: Optional[Base]) -> Optional[Entry]:
    """The entry ``base`` names, if the cache still holds it at that length (the handle is
    replaced by a rewind, so an identical handle means rows ``[0, length)`` are unchanged)."""
    if base is None or not isinstance(base.kv, MlxKV):
        return None
    for entry in cache.entries():
        if entry.kv is base.kv and entry.length == base.length == base.kv.length and not entry.is_anchor:
            return entry
    return None


def restored_base(pending: Optional[Pending]) -> Optional[Base]:
    """A row that restored at an entry's head holds that entry's rows: its ``Base``."""
    plan = getattr(pending, "plan", None)
    entry = getattr(plan, "entry", None)
    if plan is None or entry is None or plan.checkpoint is not None or entry.is_anchor \
            or plan.length != entry.length:
        return None
    return Base(entry.kv, plan.length)


def reply_capacity(settings: CopyFreeSettings, length: int, prompt_len: int, max_tokens: Optional[int]) -> int:
    """Rows a prompt-end copy of ``length`` rows (of a ``prompt_len``-token prompt) allocates so
    that its reply is appended in place when the row ends: the prompt's last rows, ``max_tokens``
    (unknown: the decode reserve) and, with lending on, the next turn's decode reserve and lend
    headroom; at most ``settings.spare_allowed`` rows past ``length``."""
    reply = settings.decode_reserve if max_tokens is None else max(0, int(max_tokens))
    later = settings.decode_reserve + settings.lend_headroom if settings.lending else 0
    needed = length + min(prompt_len - length + reply + later, settings.spare_allowed(length))
    bucket = copyfree_merge.capacity(needed)  # equal sizes turn after turn: MLX's pool reuses them
    return bucket if settings.adoptable(length, bucket) else needed


def copy_with_room(layout: CacheLayout, caches: Sequence[Any], idx: Optional[int], length: int,
                   capacity: int) -> MlxKV:
    """Row ``idx``'s first ``length`` KV rows copied out (one allocation per buffer) into
    buffers of ``capacity`` rows, the rows past ``length`` spare: the entry a reply appends to
    (``append_reply``). Quantized layers, and no room asked for, copy exactly."""
    if layout.packed or capacity <= length:
        return rows.kv_rows(layout, caches, idx, length, copy=True)
    views = rows.kv_rows(layout, caches, idx, length, copy=False)
    spare = capacity - length
    layers = [[{key: copyfree_merge.padded(value[..., :length, :], spare) if key in ("keys", "values") else
                mx.array(value) if isinstance(value, mx.array) else value
                for key, value in child.items()} for child in layer] for layer in views.layers]
    kv = MlxKV(layers, length)
    mx.eval(kv.arrays())
    if ledger.enabled():
        ledger.add("extract", kv.nbytes, kind="kv")
    return kv


def append_reply(layout: CacheLayout, cache: LineageCache, base: Optional[Base], caches: Sequence[Any], idx: int,
                 length: int) -> Optional[Appended]:
    """Row ``idx``'s ``length`` KV rows as ``base``'s entry's own buffer with the rows it lacks
    written in, under a loan receipt ``Appended.finish`` ends; None where it cannot be
    (the caller copies the whole row)."""
    entry = base_entry(cache, base)
    if entry is None:
        return None
    entry_kv = _mlx_kv(entry)
    if layout.packed or entry_kv.capacity("keys") < length or entry_kv.capacity("values") < length:
        return None
    # ``LineageCache.lend`` reads only the plan's entry: a plan at the entry's head.
    loan = cache.lend(RestorePlan(entry.length, RestoreKind.ENTRY, entry=entry))
    if loan is None:  # lent, or queued for writing: its rows are being read
        return None
    start = entry.length
    try:
        taken = entry_kv.lend()
    except Exception:
        cache.end(loan)
        raise
    try:
        layers, written, pooled = rows.append_rows(layout, list(caches), idx, taken, start, length)
        kv = MlxKV(layers, length)
        mx.eval(kv.arrays())
    except Exception as exc:
        entry_kv.give_back(taken)
        cache.end(loan)
        log.info("apc_lineage reply rows not appended to entry %s (%s): the row is copied", entry.id, exc)
        return None
    if ledger.enabled():
        ledger.add("reply_append", written, kind="kv")
        ledger.add("reply_append", pooled, kind="pooled")
    return Appended(kv, entry, loan, written, length - start)


def _lent_part(layers: list[list[Arrays]]) -> list[list[Arrays]]:
    """The ``keys``/``values`` arrays of a handle's layers: what ``MlxKV.give_back`` takes back."""
    return [[{k: ref(v) for k, v in child.items() if k in ("keys", "values")} for child in layer]
            for layer in layers]


__all__ = ["Appended", "Base", "append_reply", "base_entry", "copy_with_room", "reply_capacity",
           "restored_base"]
