"""The batch merge: the one copy of a warm turn, with room for what comes next.

Stock ``BatchKVCache.merge`` (models/cache.py:1738-1766) allocates exactly the restored length,
so the suffix's first forward regrows every KV layer by concatenation (cache.py:1583-1600): a
second full copy before the first token. Here each append-only KV child is copied once into a
buffer of ``capacity`` rows (prefix + the longest suffix + a decode reserve, rounded to a size
bucket so that MLX's pool can hand the same buffer back a turn later). Snapshot children
(recurrent state, pooling buffers) are small and use mlx-vlm's own merges.

Only float ``KVCache`` rows (what the lineage restore builds, and fresh cold rows) take this
path; anything else falls back to the stock merge.

``stage_rows`` is the same copy made ahead, off the generation thread, while the request still
waits in the queue (``integration.staging``): its buffers have the capacity this merge would
give the lone row, so the merge then adopts them as a lent buffer is adopted and copies nothing.
It also makes the zero buffers of the joint batch the staged row will join (two rows of that
capacity, into the runtime's ``copyfree.spares.JointSpares``), so the join writes into memory already mapped.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import mlx.core as mx
from mlx_vlm.apc_adapters import merge_cache_entries
from mlx_vlm.models.cache import BatchKVCache, CacheList, KVCache

from server_patch.copyfree import batch
from server_patch.copyfree.spares import JointSpares
from server_patch.observe import ledger
from server_patch.state.registry import Arrays
from server_patch.state.rows import leaf_caches

MIN_BUCKET = 256


def capacity(needed: int) -> int:
    """``needed`` rounded up to its size bucket: 256 rows, or 1/16 of the size (a power of
    two) for long contexts, so consecutive turns of a conversation allocate equal sizes and
    the dead rows past the prompt stay under ~6 %."""
    bucket = MIN_BUCKET
    while bucket * 32 <= needed:
        bucket *= 2
    return -(-max(needed, 1) // bucket) * bucket


def merge_rows(row_caches: Sequence[Sequence[Any]], prefix_lens: Sequence[int],
               suffix_lens: Sequence[int], reserve: int, *, headroom: int = 0,
               lend: bool = False) -> Optional[list[Any]]:
    """Batch caches of ``row_caches`` (one list of per-layer caches per row), or None.

    ``headroom``: rows allocated past ``reserve`` (room for later turns of a lone request).
    ``lend``: a lone row whose KV caches hold a lent buffer with room for the suffix and the
    reserve becomes the batch cache around that very buffer: no copy, appends in place.
    """
    if not row_caches or len(row_caches) != len(prefix_lens):
        return None
    layers = len(row_caches[0])
    if any(len(row) != layers for row in row_caches):
        return None
    rows_needed = max(prefix_lens) + max(suffix_lens, default=0) + reserve
    cap = capacity(rows_needed + headroom)
    in_place = rows_needed if lend and len(row_caches) == 1 else 0
    out = []
    for i in range(layers):
        merged = _merge([row[i] for row in row_caches], prefix_lens, cap, in_place)
        if merged is None:
            return None
        out.append(merged)
    if in_place:
        _release_kv(row_caches[0])  # the batch caches are now the buffers' only holders
    mx.eval([cache.state for cache in out])  # nested lists and tuples; non-array leaves skipped
    return out


def stage_rows(layers: Sequence[Sequence[Arrays]], kv_children: Sequence[Sequence[bool]], length: int,
               cap: int, joint: JointSpares | None = None) -> tuple[list[list[Arrays]], list[list[Arrays]]]:
    """Rows ``[:length]`` of each float KV child of ``layers`` (an entry's ``MlxKV.layers``;
    ``kv_children`` marks those children) copied into fresh buffers of ``cap`` rows, evaluated:
    the merge's copy of a lone restored row, made ahead. Returns ``CacheLayout.build_lent``'s
    two halves: the new ``keys``/``values`` per child, and every child's other arrays (by
    reference: small, and the stock merges copy them). Counted as ``stage`` in the ledger.
    ``joint``: the runtime's spares, where the zero buffers of the joint batch the staged row
    will join are made too (while rows decode; None: none are made).
    Any thread may call it: it reads evaluated arrays and writes only its own."""
    taken: list[list[Arrays]] = []
    kept: list[list[Arrays]] = []
    nbytes = 0
    for layer, flags in zip(layers, kv_children, strict=True):
        taken_layer: list[Arrays] = []
        kept_layer: list[Arrays] = []
        for child, is_kv in zip(layer, flags, strict=True):
            keys, values = child.get("keys"), child.get("values")
            if is_kv and isinstance(keys, mx.array) and isinstance(values, mx.array):
                if int(keys.shape[2]) < length or int(values.shape[2]) < length:
                    raise ValueError(f"KV rows hold {int(keys.shape[2])} tokens, staging wants {length}")
                spare = max(cap, length) - length
                taken_layer.append({"keys": padded(keys[..., :length, :], spare),
                                    "values": padded(values[..., :length, :], spare)})
                kept_layer.append({k: v for k, v in child.items() if k not in ("keys", "values")})
                rows = int(keys.shape[2]) or 1
                nbytes += (int(keys.nbytes) + int(values.nbytes)) // rows * length
            else:
                taken_layer.append({})
                kept_layer.append(dict(child))
        taken.append(taken_layer)
        kept.append(kept_layer)
    staged = [v for layer in taken for child in layer for v in child.values()]
    mx.eval(staged)
    if ledger.enabled():
        ledger.add("stage", nbytes, kind="kv")
    if joint is not None and batch.takes_joins():  # rows decode while a turn is staged: its join's buffer
        joint.reserve(staged)
    return taken, kept


def _release_kv(caches: Sequence[Any]) -> None:
    for child in leaf_caches(caches):
        if type(child) is KVCache:
            child.keys = child.values = None


def _merge(entries: list[Any], prefix_lens: Sequence[int], cap: int, in_place: int) -> Any:
    if all(type(e) is KVCache for e in entries):
        if in_place and entries[0].keys is not None and int(entries[0].keys.shape[2]) >= in_place:
            return adopt_kv(entries[0])
        return merge_kv(entries, cap)
    if all(type(e) is CacheList for e in entries):
        children = [_merge([e.caches[j] for e in entries], prefix_lens, cap, in_place)
                    for j in range(len(entries[0].caches))]
        # mlx-vlm's CacheList and merge_cache_entries are untyped
        return None if any(c is None for c in children) else CacheList(*children)  # type: ignore[no-untyped-call]
    return merge_cache_entries(entries, prefix_lens)  # type: ignore[no-untyped-call]  # stock merges snapshots


def merge_kv(rows: Sequence[KVCache], cap: int) -> BatchKVCache:
    """Single-row ``KVCache`` rows as one left-padded ``BatchKVCache`` of ``cap`` rows.

    Same layout as ``BatchKVCache.merge`` (row i right-aligned at the longest prefix, offset
    = its own length), but with ``cap - longest`` spare rows after ``_idx``.
    """
    buffers = [_kv_buffers(r) for r in rows]
    lengths = [0 if b is None else int(r.offset) for r, b in zip(rows, buffers)]
    longest = max(lengths)
    if longest == 0:
        return BatchKVCache([0] * len(rows))
    template_keys, template_values = next(b for b in buffers if b is not None)
    batch, heads = len(rows), int(template_keys.shape[1])
    dk, dv, dtype = int(template_keys.shape[3]), int(template_values.shape[3]), template_keys.dtype
    cap = max(cap, longest)
    padding = [longest - n for n in lengths]
    if batch == 1:
        keys = padded(template_keys[..., :longest, :], cap - longest)
        values = padded(template_values[..., :longest, :], cap - longest)
    else:
        keys = mx.zeros((batch, heads, cap, dk), dtype=dtype)
        values = mx.zeros((batch, heads, cap, dv), dtype=dtype)
        for i, (pad, n, found) in enumerate(zip(padding, lengths, buffers)):
            if n and found is not None:  # a row with rows has its buffers
                keys[i: i + 1, :, pad: pad + n] = found[0][..., :n, :]
                values[i: i + 1, :, pad: pad + n] = found[1][..., :n, :]
    cache = BatchKVCache(padding)
    _set_kv(cache, keys, values)
    cache.offset += longest
    cache._idx = longest
    if ledger.enabled():
        row_bytes = sum(_row_bytes(r) * n for r, n in zip(rows, lengths))
        ledger.add("merge", row_bytes, kind="kv")
    return cache


def adopt_kv(row: KVCache) -> BatchKVCache:
    """A one-row ``BatchKVCache`` around ``row``'s own buffers: the suffix is written into
    the spare rows in place, as long as nothing else references them (``merge_rows`` takes
    them from the row once every layer merged)."""
    length = int(row.offset)
    cache = BatchKVCache([0])
    _set_kv(cache, row.keys, row.values)
    cache.offset += length
    cache._idx = length
    return cache


def padded(rows: mx.array, spare: int) -> mx.array:
    """One allocation: the rows (axis 2) copied, then ``spare`` zero rows."""
    if spare <= 0:
        return mx.array(rows)  # a copy: mx.contiguous shares an already contiguous view
    shape = (*rows.shape[:2], spare, *rows.shape[3:])
    return mx.concatenate([rows, mx.zeros(shape, dtype=rows.dtype)], axis=2)


def _kv_buffers(row: KVCache) -> tuple[mx.array, mx.array] | None:
    """A ``KVCache``'s keys and values (mlx-vlm sets both or neither); None while it is empty."""
    if row.keys is None or row.values is None:
        return None
    return row.keys, row.values


def _set_kv(cache: BatchKVCache, keys: Optional[mx.array], values: Optional[mx.array]) -> None:
    """``cache``'s buffers are ``keys``/``values``."""
    # mlx-vlm's BatchKVCache.__init__ types them as None (the value it starts with)
    cache.keys, cache.values = keys, values  # type: ignore[assignment]


def _row_bytes(row: KVCache) -> int:
    found = _kv_buffers(row)
    if found is None:
        return 0
    keys, values = found
    rows = int(keys.shape[2]) or 1
    return (int(keys.nbytes) + int(values.nbytes)) // rows
