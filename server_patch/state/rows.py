"""One row of a live (possibly batch-shaped) prompt cache, as single-row cache objects.

A checkpoint needs only the snapshot layers, so ``capture`` skips the append-only rows and
never touches the derived projected cache: no KV copy at all. An entry needs the KV rows too:

* ``extract``: rows and snapshot at once, the KV rows copied out of the live buffer (the one
  copy of a commit made while the request keeps writing that buffer);
* ``kv_rows(copy=False)``: the KV rows as views of the live buffer, for a buffer nobody will
  write again (the request ended, or its rows moved to a new batch buffer). The entry then
  holds the request's own buffer: no copy. A lone row keeps the whole buffer, so the rows
  past the entry (decode tokens, spare capacity) are room the next turn can be lent
  (``server_patch.copyfree.lease``); until then they are dead weight.

Derived children are always skipped. KV rows of row ``idx`` start at its left padding.
"""

from __future__ import annotations

from typing import Any, Iterator, Sequence

import mlx.core as mx
from mlx_vlm.models.cache import (
    ArraysCache, BatchKVCache, BatchPoolingCache, BatchQuantizedKVCache, CacheList, KVCache, PoolingCache,
    QuantizedKVCache,
)

from server_patch.observe import ledger
from server_patch.state import quantized
from server_patch.state.layout import CacheLayout, MlxKV, MlxSnapshot
from server_patch.state.row_view import live_view
from server_patch.state.registry import DERIVED, ref


def _snapshot_row(cache: Any, idx: int | None) -> Any:
    """Row ``idx`` of a cache's snapshot part, by reference (KV children come back empty)."""
    kind = type(cache)
    if kind is KVCache or kind is PoolingCache:
        return cache  # already one row: the codec takes references
    if kind is ArraysCache:
        if idx is None:
            return cache
        row = ArraysCache(len(cache.cache))
        row.cache = [None if x is None else x[idx: idx + 1] for x in cache.cache]
        return row
    if kind is BatchKVCache:
        return KVCache()
    if kind is BatchQuantizedKVCache or kind is QuantizedKVCache:
        return QuantizedKVCache(group_size=int(cache.group_size), bits=int(cache.bits))  # KV: none here
    if kind is BatchPoolingCache:
        i = idx or 0
        row = PoolingCache(cache.ratio)
        remainder = int(cache.remainder[i])
        if cache.buf_kv is not None and remainder > 0:
            row.buf_kv = cache.buf_kv[i: i + 1]
            row.buf_gate = cache.buf_gate[i: i + 1]
            row.remainder = remainder
        return row
    extract = getattr(cache, "extract", None)
    if callable(extract) and idx is not None:
        return extract(idx)
    return cache


def _take(x: mx.array, index: tuple, copy: bool) -> mx.array:
    view = x[index]
    return mx.array(view) if copy else view  # mx.contiguous would share an already contiguous view


def _kv_row(cache: Any, idx: int | None, length: int, copy: bool) -> Any:
    """Row ``idx`` of an append-only cache, ``length`` tokens, as a single-row cache."""
    kind = type(cache)
    i = idx or 0
    if kind is QuantizedKVCache or kind is BatchQuantizedKVCache:
        return quantized.row(cache, idx, length, copy)
    if kind is KVCache or kind is BatchKVCache:
        row = KVCache()
        if cache.keys is None or length <= 0:
            return row
        start = int(cache.left_padding[i].item()) if kind is BatchKVCache else 0
        held = (int(cache._idx) if kind is BatchKVCache else int(cache.offset)) - start
        if held < length:
            raise ValueError(f"row {i} holds {held} KV rows, the entry needs {length}")
        if not copy and live_view(cache) is not None:
            copy = True  # a view of a buffer that still holds rows that left: copied, not pinned
        if not copy and start == 0 and int(cache.keys.shape[0]) == 1:
            # The row is the whole buffer: keep all of it, spare rows included, so the turn
            # that extends this entry can be lent the buffer and append in place. The codec
            # keeps ``offset`` rows; the entry's own length is the handle's.
            row.keys, row.values = cache.keys, cache.values
            row.offset = int(cache.keys.shape[2])
            return row
        rows = slice(start, start + length)
        batch = slice(i, i + 1) if kind is BatchKVCache else slice(None)
        row.keys = _take(cache.keys, (batch, slice(None), rows), copy)
        row.values = _take(cache.values, (batch, slice(None), rows), copy)
        row.offset = length
        return row
    if kind is PoolingCache or kind is BatchPoolingCache:
        row = PoolingCache(cache.ratio)
        windows = length // int(cache.ratio)
        if cache.pooled is not None and windows:
            batch = slice(i, i + 1) if kind is BatchPoolingCache else slice(None)
            if int(cache.pooled.shape[1]) < windows:
                raise ValueError(f"row {i} holds fewer than {windows} pooled windows")
            row.pooled = _take(cache.pooled, (batch, slice(0, windows)), copy)
        return row
    return cache


def _kv_child(codec_name: str) -> bool:
    return codec_name in ("kv", "pooling") or quantized.is_packed(codec_name)


def row_caches(layout: CacheLayout, caches: Sequence[Any], idx: int | None, *, kv: bool,
               length: int = 0, copy: bool = True) -> list[Any]:
    """Single-row cache objects for row ``idx`` (None: the caches are already one row).

    ``kv=False``: the snapshot layers only. ``kv=True``: the append-only layers' first
    ``length`` rows (copied, or views with ``copy=False``), snapshot layers by reference.
    """
    out = []
    for layer, cache in zip(layout.layers, caches):
        children = list(cache.caches) if layer.composite else [cache]
        built = []
        for codec, child in zip(layer.codecs, children):
            if codec is DERIVED:
                built.append(KVCache())
            elif kv and _kv_child(codec.name):
                built.append(_kv_row(child, idx, length, copy))
            else:
                built.append(_snapshot_row(child, idx))
        out.append(CacheList(*built) if layer.composite else built[0])
    return out


def capture(layout: CacheLayout, caches: Sequence[Any], idx: int | None, length: int) -> MlxSnapshot:
    """The snapshot layers of row ``idx`` at ``length`` tokens: references, no KV copy."""
    return layout.snapshot(row_caches(layout, caches, idx, kv=False), length)


def kv_rows(layout: CacheLayout, caches: Sequence[Any], idx: int | None, length: int, *,
            copy: bool) -> MlxKV:
    """The append-only rows of row ``idx``, ``length`` tokens: copies, or views (``copy=False``)."""
    kv, _ = layout.split(row_caches(layout, caches, idx, kv=True, length=length, copy=copy), length)
    if copy and ledger.enabled():
        ledger.add("extract", kv.nbytes, kind="kv")
    return kv


def extract(layout: CacheLayout, caches: Sequence[Any], idx: int | None, length: int) -> tuple[MlxKV, MlxSnapshot]:
    """KV rows (copied) and snapshot of row ``idx`` at ``length`` tokens: a commit's one copy."""
    return kv_rows(layout, caches, idx, length, copy=True), capture(layout, caches, idx, length)


def append_rows(layout: CacheLayout, caches: Sequence[Any], idx: int, lent: list[list[dict]], start: int,
                length: int) -> tuple[list[list[dict]], int, int]:
    """Row ``idx`` of a shared batch's caches, as buffers an entry of ``start`` tokens lent
    (``MlxKV.lend``: per layer, per child, ``keys``/``values``): rows ``[start, length)`` written
    into their spare rows, in place while nothing else holds them. The pooled windows (small:
    one per ``ratio`` tokens, held exactly sized) are copied whole from the row. Returns the
    handle's layers (the KV children are ``lent``'s arrays, updated), the KV bytes written and
    the pooled bytes copied.
    Raises if a buffer lacks room or the row does not hold ``length`` rows."""
    layers, written, pooled = [], 0, 0
    for layer, cache, taken_layer in zip(layout.layers, caches, lent):
        children = list(cache.caches) if layer.composite else [cache]
        out_layer: list[dict] = []
        for codec, child, taken in zip(layer.codecs, children, taken_layer):
            if codec is DERIVED or not _kv_child(codec.name):
                out_layer.append({})
            elif codec.name == "kv":
                out_layer.append(_append_kv(child, idx, taken, start, length))
                written += sum(int(v.nbytes) // int(v.shape[2]) * (length - start) for v in out_layer[-1].values())
            elif codec.name == "pooling":
                row = _kv_row(child, idx, length, copy=True)
                out_layer.append({"ratio": int(child.ratio), **({} if row.pooled is None else {"pooled": row.pooled})})
                pooled += 0 if row.pooled is None else int(row.pooled.nbytes)
            else:  # a packed (quantized) layer: its merge copies, there is no buffer to append to
                raise ValueError(f"cannot append to a {codec.name} layer")
        layers.append(out_layer)
    return layers, written, pooled


def _append_kv(cache: Any, idx: int, taken: dict, start: int, length: int) -> dict:
    """One KV child: rows ``[start, length)`` of row ``idx`` into the lent buffers ``taken``."""
    if type(cache) is not BatchKVCache or cache.keys is None or set(taken) != {"keys", "values"}:
        raise ValueError("only a batch cache's float rows append into a lent buffer")
    pad = int(cache.left_padding[idx].item())
    if int(cache._idx) - pad < length:
        raise ValueError(f"row {idx} holds {int(cache._idx) - pad} KV rows, the entry needs {length}")
    keys, values = taken["keys"], taken["values"]
    if min(int(keys.shape[2]), int(values.shape[2])) < length:
        raise ValueError(f"the entry's buffer holds {int(keys.shape[2])} rows, the reply needs {length}")
    source = (slice(idx, idx + 1), slice(None), slice(pad + start, pad + length))
    keys[..., start:length, :] = cache.keys[source]  # rebinds: in place while ``keys`` is the only holder
    values[..., start:length, :] = cache.values[source]
    return {"keys": keys, "values": values}


def leaf_caches(caches: Sequence[Any]) -> Iterator[Any]:
    """Every per-layer cache, with the children of ``CacheList`` layers in place of the list."""
    for cache in caches:
        yield from (cache.caches if type(cache) is CacheList else (cache,))


def buffer_rows(caches: Sequence[Any]) -> int:
    """Rows of the largest append-only buffer (the capacity an adopted entry would pin)."""
    rows = 0
    for child in leaf_caches(caches):
        keys = getattr(child, "keys", None)
        if isinstance(keys, mx.array) and type(child) in (KVCache, BatchKVCache):
            rows = max(rows, int(keys.shape[2]))
    return rows


def kept_in_place(caches: Sequence[Any]) -> bool:
    """Whether a layer's rows are a view of a buffer that still holds rows that left the batch
    (``state.row_view``): such rows are copied out, never adopted (the buffer would be pinned)."""
    return any(live_view(child) is not None for child in leaf_caches(caches))


def fed_lengths(layout: CacheLayout, caches: Sequence[Any], idx: int) -> set[int]:
    """The token counts row ``idx``'s stored KV caches say they hold (derived children
    skipped): one value when the row is consistent, several when it is not, none when it
    has no KV cache to tell. ``BatchKVCache`` is asked twice: its write index past the row's
    left padding, and the row's own offset."""
    found: set[int] = set()
    for layer, cache in zip(layout.layers, caches):
        children = list(cache.caches) if layer.composite else [cache]
        for codec, child in zip(layer.codecs, children):
            if codec is DERIVED or not _kv_child(codec.name):
                continue
            kind = type(child)
            if kind is BatchKVCache:
                found.add(int(child._idx) - int(child.left_padding[idx].item()))
                found.add(int(child.offset[idx].item()))
            elif kind is KVCache and idx == 0:
                found.add(int(child.offset))
            else:
                found |= quantized.fed_lengths(child, idx)
    return found


def batch_size(caches: Sequence[Any]) -> int:
    """Rows of a live prompt cache (1 for single-sequence caches)."""
    for child in leaf_caches(caches):
        if type(child) is BatchKVCache or type(child) is BatchQuantizedKVCache:
            return int(child.batch_size)
        if type(child) is BatchPoolingCache:
            return len(child.remainder)
        if type(child) is ArraysCache and child.cache and child.cache[0] is not None:
            return int(child.cache[0].shape[0])
    return 1


__all__ = ["append_rows", "batch_size", "buffer_rows", "capture", "extract", "fed_lengths", "kv_rows", "leaf_caches", "ref",
           "row_caches"]
