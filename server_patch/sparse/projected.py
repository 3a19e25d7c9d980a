"""The per-head "projected" K/V cache of glm5_next's sparse layers, treated as derived state.

Stock mlx-vlm keeps, beside the 512-wide latent cache, a per-head copy of every token's keys
and values (H x (256 + 256) values, 64x the latent). It is a pure function of the latent:

* it is never worth storing (cache entries, checkpoints, disk): ``is_projected_child`` tells
  the cache registry which CacheList child it is;
* it is needed only by chunks that take the unabsorbed path; ``sync_projection`` brings it in
  line with the latent there, projecting only what is missing (after a restore that is the
  whole context, once; later long chunks then project only their own tokens);
* chunks that take the gathered path do not need it, and ``release`` frees it there rather
  than keeping gigabytes of stale per-head K/V resident.
"""

from __future__ import annotations

from typing import Any, Optional

import mlx.core as mx

# Stock's bound on the projected cache (language.py: _MAX_PROJECTED_PREFILL_TOKENS).
MAX_PROJECTED_TOKENS = 32768

FULL_INDEXER_SLOT = 3  # CacheList(latent, index flags, pooled index keys, projected)
SHARED_INDEXER_SLOT = 1  # CacheList(latent, projected)


def projected_child_index(cache_list: Any) -> Optional[int]:
    """Which child of a glm5_next sparse layer's CacheList is the projected cache, if any.

    Full-indexer layers (and the MTP drafter) use 4 children with a pooling cache third.
    Shared-indexer layers use 2 KV children. Other models use 2-child lists too (deepseek_v32,
    glm_moe_dsa: latent + k_pe/indexer keys), so a 2-child list counts only when its latent
    child stores zero-width values, which is glm5_next's signature ([B, 1, T, 0]); an empty
    latent cannot be told apart and is reported as not projected.
    """
    children = tuple(getattr(cache_list, "caches", ()))
    if len(children) == 4 and "PoolingCache" in type(children[2]).__name__:
        return FULL_INDEXER_SLOT
    if len(children) == 2:
        values = getattr(children[0], "values", None)
        if isinstance(values, mx.array) and values.ndim == 4 and values.shape[-1] == 0:
            return SHARED_INDEXER_SLOT
    return None


def is_projected_child(cache_list: Any, index: int) -> bool:
    """True when ``cache_list[index]`` is derived per-head K/V that must not be stored."""
    return projected_child_index(cache_list) == index


def projected_slot(layer: Any) -> int:
    """The projected child's index for a ``Glm5NextAttention`` layer (authoritative form)."""
    return SHARED_INDEXER_SLOT if layer.indexer is None else FULL_INDEXER_SLOT


def project(layer: Any, latent: mx.array) -> tuple[mx.array, mx.array]:
    """Per-head keys [B, H, n, d] and values [B, H, n, v] of latent rows [B, 1, n, r]."""
    return layer.embed_q(latent, transpose=False), layer.unembed_out(latent)


def cached_length(cache: Any) -> int:
    """Tokens held (including left padding), for single and batch KV caches alike."""
    return int(cache.size())


def release(cache: Any) -> None:
    """Drop the projected arrays; the cache reads as empty and is rebuilt when next needed."""
    if cache is None or getattr(cache, "keys", None) is None or not _is_plain(cache):
        return
    cache.keys = cache.values = None
    if isinstance(cache.offset, mx.array):  # BatchKVCache: back to its constructor state
        cache._idx = 0
        cache.offset = -cache.left_padding
    else:
        cache.offset = 0


def _is_plain(cache: Any) -> bool:
    """Float KV caches we know how to rebuild; anything else keeps stock behaviour."""
    from mlx_vlm.models.cache import BatchKVCache, KVCache

    return type(cache) in (KVCache, BatchKVCache)


def _batch_rows_match(cache: Any, latent_cache: Any, new_tokens: int) -> bool:
    """Per-row bookkeeping agrees once the chunk's ``new_tokens`` (already in the latent) are
    counted; batch caches are filtered, extended and rolled row by row."""
    return bool(
        mx.all(cache.offset + new_tokens == latent_cache.offset).item()
        and mx.all(cache.left_padding == latent_cache.left_padding).item()
    )


def reusable_length(cache: Any, latent_cache: Any, context: int, new_tokens: int) -> int:
    """Leading tokens of the projected cache that match the latent (0: rebuild from scratch).

    ``context`` is the latent length including the chunk's ``new_tokens``. A single-sequence
    cache that fell behind (short chunks do not update it) keeps its prefix: both caches are
    only ever trimmed together, so a shorter projection is a projection of the latent's prefix.
    A batch cache is reused only when exactly in sync, because row filters, extends and rolls
    can move a stale prefix.
    """
    if (
        cache is None
        or latent_cache is None
        or not _is_plain(cache)
        or cache.keys is None
        or context > MAX_PROJECTED_TOKENS
    ):
        return 0
    have = cached_length(cache)
    stale = context - new_tokens - have
    if stale < 0:
        return 0
    if isinstance(cache.offset, mx.array) and (
        stale or not _batch_rows_match(cache, latent_cache, new_tokens)
    ):
        return 0
    return have


def _rebuild(layer: Any, cache: Any, latent: mx.array, latent_cache: Any) -> None:
    """Replace the cache with the projection of the whole latent, mirroring its buffer layout."""
    keys, values = project(layer, latent)
    length = latent.shape[2]
    capacity = max(length, latent_cache.keys.shape[2])
    if capacity > length:  # same capacity as the latent buffer, so per-row rolls agree
        pad = [(0, 0), (0, 0), (0, capacity - length), (0, 0)]
        keys, values = mx.pad(keys, pad), mx.pad(values, pad)
    cache.keys, cache.values = keys, values
    if isinstance(cache.offset, mx.array):
        cache._idx = length
        cache.offset = mx.array(latent_cache.offset)
        cache.left_padding = mx.array(latent_cache.left_padding)
    else:
        cache.offset = length


def sync_projection(
    layer: Any,
    cache: Optional[Any],
    latent: mx.array,
    new_tokens: int,
    latent_cache: Optional[Any],
) -> tuple[mx.array, mx.array]:
    """Projected keys and values for the whole latent [B, 1, T, r], reusing the cache.

    Projects only what ``reusable_length`` says is missing: the chunk's own tokens when in
    sync, the missing suffix when a single-sequence cache fell behind, the whole latent once
    when the cache is empty (after a restore or ``release``) or inconsistent. Above
    ``MAX_PROJECTED_TOKENS`` nothing is kept (stock's memory bound).
    """
    length = latent.shape[2]
    if cache is None or latent_cache is None or not _is_plain(cache):
        return project(layer, latent)
    if length > MAX_PROJECTED_TOKENS:
        release(cache)
        return project(layer, latent)
    have = reusable_length(cache, latent_cache, length, new_tokens)
    if have == 0:
        _rebuild(layer, cache, latent, latent_cache)
    else:
        cache.update_and_fetch(*project(layer, latent[:, :, have:]))
    return cache.keys[..., :length, :], cache.values[..., :length, :]
