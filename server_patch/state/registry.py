"""How each mlx-vlm cache class splits into append-only rows and a snapshot, keyed by class.

Append-only layers (``KVCache``, the pooled part of ``PoolingCache``) store nothing in a
checkpoint: rows [:n] of a longer state are the state at n, so they restore by truncation.
Snapshot layers (``ArraysCache`` recurrent + conv state, ``RotatingKVCache``, the remainder
buffer of ``PoolingCache``) keep a reference to their arrays. Derived children (glm5_next's
projected per-head K/V) keep nothing and restore empty: the model rebuilds them.

An unregistered class is a clear error when the model is checked at startup, never a wrong restore;
classes with a known reason (``REFUSED``: TurboQuant KV, diffusion caches) say what to change.
Uniform quantized KV (``--kv-bits 4``/``8``) is append-only like ``KVCache``: its codec is
``state.quantized``, one per bits and group size (``packed_codec``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import mlx.core as mx
from mlx_vlm.models.cache import (
    ArraysCache, BatchQuantizedKVCache, CacheList, ChunkedKVCache, KVCache, PoolingCache,
    QuantizedKVCache, RotatingKVCache, StaticPrefixKVCache,
)

from server_patch.state import quantized
from server_patch.state.options import TURBOQUANT_REFUSAL, KVQuant
from server_patch.state.options import UnsupportedCacheError, check_options  # noqa: F401 (re-export)

Arrays = dict[str, Any]


@dataclass(frozen=True)
class Codec:
    """Split a live cache into (rows, snapshot) and build a fresh cache from them at a length."""

    name: str
    split: Callable[[Any], tuple[Arrays, Arrays]]
    build: Callable[[Arrays, Arrays, int], Any]
    rule: str = ""  # how it restores, in a few words (apcctl model check, docs/models.md)


def ref(x: Any) -> Any:
    """A new array object over the same data.

    ``a[i:j] = v`` rebinds the Python object ``a`` to the updated value, so a stored state must
    never share an array *object* with a live cache (in either direction); sharing the data is
    safe, because a slice update copies when another reference exists.
    """
    return x[...] if isinstance(x, mx.array) else x


def _rows_len(x: mx.array | None, axis: int) -> int:
    return 0 if x is None else int(x.shape[axis])


# --- KVCache: append-only along axis 2 -------------------------------------------------------

def _kv_split(cache: KVCache) -> tuple[Arrays, Arrays]:
    if cache.keys is None:
        return {}, {}
    n = cache.offset
    return {"keys": cache.keys[..., :n, :], "values": cache.values[..., :n, :]}, {}


def _kv_build(rows: Arrays, snap: Arrays, length: int) -> KVCache:
    cache = KVCache()
    if "keys" in rows and length > 0:
        if _rows_len(rows["keys"], 2) < length:
            raise ValueError(f"KV rows hold {_rows_len(rows['keys'], 2)} tokens, restore wants {length}")
        cache.keys = rows["keys"][..., :length, :]
        cache.values = rows["values"][..., :length, :]
        cache.offset = length
    return cache


# --- ArraysCache: recurrent + conv state, a snapshot -----------------------------------------

def _arrays_split(cache: ArraysCache) -> tuple[Arrays, Arrays]:
    return {}, {f"s{i}": ref(x) for i, x in enumerate(cache.cache)} | {"size": len(cache.cache)}


def _arrays_build(rows: Arrays, snap: Arrays, length: int) -> ArraysCache:
    size = int(snap.get("size", 0))
    cache = ArraysCache(size)
    cache.cache = [ref(snap.get(f"s{i}")) for i in range(size)]
    return cache


# --- PoolingCache: pooled windows append-only along axis 1; remainder buffer is a snapshot ---

def _pool_split(cache: PoolingCache) -> tuple[Arrays, Arrays]:
    rows: Arrays = {"ratio": int(cache.ratio)}
    if cache.pooled is not None:
        rows["pooled"] = ref(cache.pooled)
    snap: Arrays = {"ratio": int(cache.ratio), "remainder": int(cache.remainder)}
    if cache.buf_kv is not None:
        snap["buf_kv"], snap["buf_gate"] = ref(cache.buf_kv), ref(cache.buf_gate)
    return rows, snap


def _pool_build(rows: Arrays, snap: Arrays, length: int) -> PoolingCache:
    ratio = int(snap["ratio"])
    cache = PoolingCache(ratio)
    windows = length // ratio
    if windows:
        if _rows_len(rows.get("pooled"), 1) < windows:
            raise ValueError("pooled rows shorter than the restore length")
        cache.pooled = rows["pooled"][:, :windows]
    if int(snap["remainder"]) != length % ratio:
        raise ValueError(f"pooling remainder {snap['remainder']} does not match length {length}")
    cache.remainder = int(snap["remainder"])
    cache.buf_kv, cache.buf_gate = ref(snap.get("buf_kv")), ref(snap.get("buf_gate"))
    return cache


# --- RotatingKVCache: the window is not append-only, so all of it is a snapshot --------------

def _rotating_split(cache: RotatingKVCache) -> tuple[Arrays, Arrays]:
    snap: Arrays = {"max_size": cache.max_size, "keep": cache.keep, "offset": cache.offset,
                    "idx": cache._idx}
    if cache.keys is not None:
        snap["keys"], snap["values"] = ref(cache.keys), ref(cache.values)
    return {}, snap


def _rotating_build(rows: Arrays, snap: Arrays, length: int) -> RotatingKVCache:
    cache = RotatingKVCache(int(snap["max_size"]), keep=int(snap["keep"]))
    cache.keys, cache.values = ref(snap.get("keys")), ref(snap.get("values"))
    cache.offset, cache._idx = int(snap["offset"]), int(snap["idx"])
    return cache


# --- ChunkedKVCache (llama4 chunked attention): the front is trimmed, so it is a snapshot ----

def _chunked_split(cache: ChunkedKVCache) -> tuple[Arrays, Arrays]:
    snap: Arrays = {"chunk_size": int(cache.chunk_size), "offset": int(cache.offset),
                    "start_position": int(cache.start_position)}
    if cache.keys is not None:
        snap["keys"], snap["values"] = ref(cache.keys), ref(cache.values)
    return {}, snap


def _chunked_build(rows: Arrays, snap: Arrays, length: int) -> ChunkedKVCache:
    if int(snap["offset"]) != length:
        raise ValueError(f"chunked cache is at {snap['offset']} tokens, restore wants {length}")
    cache = ChunkedKVCache(int(snap["chunk_size"]))
    cache.keys, cache.values = ref(snap.get("keys")), ref(snap.get("values"))
    cache.offset, cache.start_position = int(snap["offset"]), int(snap["start_position"])
    return cache


def _derived_split(cache: Any) -> tuple[Arrays, Arrays]:
    return {}, {}


def _derived_build(rows: Arrays, snap: Arrays, length: int) -> KVCache:
    return KVCache()


CODECS: dict[type, Codec] = {
    KVCache: Codec("kv", _kv_split, _kv_build, "append-only: rows [:n] restore by truncation"),
    ArraysCache: Codec("arrays", _arrays_split, _arrays_build,
                       "snapshot: recurrent/conv state by reference"),
    PoolingCache: Codec("pooling", _pool_split, _pool_build,
                        "pooled windows append-only, remainder buffer a snapshot"),
    RotatingKVCache: Codec("rotating", _rotating_split, _rotating_build,
                           "snapshot: the window and its offsets by reference"),
    ChunkedKVCache: Codec("chunked", _chunked_split, _chunked_build,
                          "snapshot: the trimmed chunk window and its offsets by reference"),
}
DERIVED = Codec("derived", _derived_split, _derived_build, "derived: not stored, rebuilt by the model")

PACKED_RULE = "append-only packed rows (--kv-bits): rows [:n] of data, scales and biases"


def packed_codec(quant: KVQuant) -> Codec:
    """The codec of a ``QuantizedKVCache`` layer at ``quant``'s bits and group size."""
    codec = quantized.PackedCodec(quant)
    return Codec(quantized.codec_name(quant), codec.split, codec.build, PACKED_RULE)


#: Classes with a known reason they are refused, by class; the message names what to change.
REFUSED: dict[type, str] = {
    StaticPrefixKVCache: (
        "the lineage cache serves autoregressive prompts; {cls} belongs to a diffusion "
        "decoder (llada2_moe, diffusion_gemma). Run this model with APC_LINEAGE=0"),
}
try:  # TurboQuant (--kv-bits with a fractional width or --kv-quant-scheme turboquant)
    from mlx_vlm.turboquant import BatchTurboQuantKVCache, TurboQuantKVCache

    REFUSED[TurboQuantKVCache] = REFUSED[BatchTurboQuantKVCache] = TURBOQUANT_REFUSAL
except ImportError:  # optional in stripped-down installations
    pass


def restore_rules() -> dict[str, str]:
    """Class name -> how the lineage cache restores it, or "refused: ..." with the reason."""
    rules = {cls.__name__: codec.rule for cls, codec in CODECS.items()}
    rules[CacheList.__name__] = "composite: each child by its own rule"
    rules[QuantizedKVCache.__name__] = rules[BatchQuantizedKVCache.__name__] = PACKED_RULE
    for cls in REFUSED:
        rules[cls.__name__] = ("refused: TurboQuant --kv-bits (use an integer --kv-bits, or APC_LINEAGE=0)"
                               if REFUSED[cls] is TURBOQUANT_REFUSAL else "refused: diffusion decoder cache")
    return rules


def codec_for(cache: Any) -> Codec:
    """The codec of ``cache``'s exact class (subclasses may change semantics, so no isinstance)."""
    codec = CODECS.get(type(cache))
    if codec is None and type(cache) is QuantizedKVCache:
        return packed_codec(KVQuant(int(cache.bits), int(cache.group_size)))
    if codec is None and type(cache) in REFUSED:
        raise UnsupportedCacheError(REFUSED[type(cache)].format(cls=type(cache).__name__))
    if codec is None:
        raise UnsupportedCacheError(
            f"lineage cache has no restore rule for {type(cache).__module__}.{type(cache).__name__}; "
            "register one in server_patch.state.registry.CODECS or run with APC_LINEAGE=0")
    return codec


def register(cls: type, codec: Codec) -> None:
    """Teach the lineage cache a new cache class."""
    CODECS[cls] = codec


def is_composite(cache: Any) -> bool:
    return type(cache) is CacheList
