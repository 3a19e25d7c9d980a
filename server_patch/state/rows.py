"""One row of a live (possibly batch-shaped) prompt cache, as single-row cache objects.

A checkpoint needs only the snapshot layers, so ``kv=False`` skips the append-only rows and
never touches the derived projected cache: no KV copy at all. The entry store (``kv=True``) is
the one row extraction of a commit; derived children are still skipped.
"""

from __future__ import annotations

from typing import Any, Sequence

from mlx_vlm.models.cache import (
    ArraysCache, BatchKVCache, BatchPoolingCache, CacheList, KVCache, PoolingCache,
)

from server_patch.state.layout import CacheLayout, MlxKV, MlxSnapshot
from server_patch.state.registry import DERIVED, ref


def _row(cache: Any, idx: int | None, kv: bool) -> Any:
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
        return cache.extract(idx or 0) if kv else KVCache()
    if kind is BatchPoolingCache:
        if kv:
            return cache.extract(idx or 0)
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


def row_caches(layout: CacheLayout, caches: Sequence[Any], idx: int | None, *, kv: bool) -> list[Any]:
    """Single-row cache objects for row ``idx`` (None: the caches are already one row)."""
    out = []
    for layer, cache in zip(layout.layers, caches):
        if layer.composite:
            children = [KVCache() if codec is DERIVED else _row(child, idx, kv)
                        for codec, child in zip(layer.codecs, cache.caches)]
            out.append(CacheList(*children))
        else:
            out.append(_row(cache, idx, kv))
    return out


def capture(layout: CacheLayout, caches: Sequence[Any], idx: int | None, length: int) -> MlxSnapshot:
    """The snapshot layers of row ``idx`` at ``length`` tokens: references, no KV copy."""
    return layout.snapshot(row_caches(layout, caches, idx, kv=False), length)


def extract(layout: CacheLayout, caches: Sequence[Any], idx: int | None, length: int) -> tuple[MlxKV, MlxSnapshot]:
    """KV rows and snapshot of row ``idx`` at ``length`` tokens (the commit's one copy)."""
    kv, snapshot = layout.split(row_caches(layout, caches, idx, kv=True), length)
    if kv.length and any(child.get("keys") is not None and int(child["keys"].shape[2]) < length
                         for layer in kv.layers for child in layer):
        raise ValueError(f"row {idx} holds fewer than {length} KV rows")
    return kv, snapshot


__all__ = ["capture", "extract", "ref", "row_caches"]
