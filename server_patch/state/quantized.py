"""Quantized KV (``--kv-bits``): mlx-vlm's ``QuantizedKVCache`` rows as an append-only codec.

``mx.quantize`` packs each token's key (and value) vector on its own: the groups of
``group_size`` run along the head dimension, never across tokens. So the packed data, the
scales and the biases are three arrays with the token on axis 2, and rows ``[:n]`` of a longer
packed state are exactly the packed state a prefill of ``n`` tokens writes, for any ``n``: on
the token axis every row is a group boundary. What is not whole at an arbitrary ``n`` is
mlx-vlm's *allocation* step (buffers grow by 256 rows, spare rows zero-filled); a restore at
``n`` keeps rows ``[:n]`` only, and the next ``update_and_fetch`` regrows from ``n`` as it does
after any prefill that ended mid-step (``prev % step != 0``).

Which layers are quantized is mlx-vlm's rule, repeated here from its own function
(``should_quantize_kv_layer``): every plain ``KVCache`` layer of the model's ``make_cache``,
but the last layer of a deep stack. A composite layer with KV children, a chunked layer and a
layer with its own ``to_batch`` are refused under ``--kv-bits`` (mlx-vlm quantizes or refuses
them in ways this codec does not model). TurboQuant stays refused (``options``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
from mlx_vlm.models.cache import BatchQuantizedKVCache, QuantizedKVCache, should_quantize_kv_layer

from server_patch.state.options import KVQuant, UnsupportedCacheError

Arrays = dict[str, Any]

#: The MlxKV child keys of one quantized layer: (data, scales, biases) of keys, then of values.
KEY_PARTS = ("k_data", "k_scales", "k_biases")
VALUE_PARTS = ("v_data", "v_scales", "v_biases")
PARTS = KEY_PARTS + VALUE_PARTS
ROW_AXIS = 2


def codec_name(quant: KVQuant) -> str:
    """The layout name: bits and group size, so a disk file never restores into another width."""
    return f"qkv{quant.bits}g{quant.group_size}"


def is_packed(name: str) -> bool:
    return name.startswith("qkv")


def quantized_layers(num_layers: int) -> list[bool]:
    """mlx-vlm's own choice (``should_quantize_kv_layer``) for each layer index."""
    return [should_quantize_kv_layer(i, num_layers) for i in range(num_layers)]


def _check(cache: Any, quant: KVQuant) -> None:
    if type(cache) is not QuantizedKVCache:
        raise UnsupportedCacheError(
            f"layer is {type(cache).__name__}, the layout expects QuantizedKVCache ({codec_name(quant)})")
    if int(cache.bits) != quant.bits or int(cache.group_size) != quant.group_size:
        raise UnsupportedCacheError(
            f"QuantizedKVCache is {cache.bits} bits, group {cache.group_size}; the layout has "
            f"{quant.bits} bits, group {quant.group_size}")


def _rows_of(cache: Any, length: int) -> Arrays:
    keys, values = cache.keys, cache.values
    return {name: part[..., :length, :] for name, part in zip(PARTS, (*keys, *values))}


@dataclass(frozen=True)
class PackedCodec:
    """split/build of one quantized layer (``registry.Codec`` takes these two functions)."""

    quant: KVQuant

    def split(self, cache: Any) -> tuple[Arrays, Arrays]:
        _check(cache, self.quant)
        if cache.keys is None or int(cache.offset) == 0:
            return {}, {}
        return _rows_of(cache, int(cache.offset)), {}

    def build(self, rows: Arrays, snap: Arrays, length: int) -> QuantizedKVCache:
        cache = QuantizedKVCache(group_size=self.quant.group_size, bits=self.quant.bits)
        if length <= 0 or "k_data" not in rows:
            return cache
        held = int(rows["k_data"].shape[ROW_AXIS])
        if held < length:
            raise ValueError(f"quantized KV rows hold {held} tokens, restore wants {length}")
        cache.keys = tuple(rows[name][..., :length, :] for name in KEY_PARTS)
        cache.values = tuple(rows[name][..., :length, :] for name in VALUE_PARTS)
        cache.offset = length
        return cache


def _take(x: mx.array, index: tuple, copy: bool) -> mx.array:
    view = x[index]
    return mx.array(view) if copy else view


def row(cache: Any, idx: int | None, length: int, copy: bool) -> QuantizedKVCache:
    """Row ``idx`` of a live quantized layer (``BatchQuantizedKVCache`` after its left padding,
    or a one-row ``QuantizedKVCache``), ``length`` tokens, as a one-row ``QuantizedKVCache``:
    copies, or views for a buffer nobody writes again."""
    out = QuantizedKVCache(group_size=int(cache.group_size), bits=int(cache.bits))
    if cache.keys is None or length <= 0:
        return out
    i = idx or 0
    batched = type(cache) is BatchQuantizedKVCache
    start = int(cache.left_padding[i].item()) if batched else 0
    held = (int(cache._idx) if batched else int(cache.offset)) - start
    if held < length:
        raise ValueError(f"row {i} holds {held} quantized KV rows, the entry needs {length}")
    index = (slice(i, i + 1) if batched else slice(None), slice(None), slice(start, start + length))
    out.keys = tuple(_take(part, index, copy) for part in cache.keys)
    out.values = tuple(_take(part, index, copy) for part in cache.values)
    out.offset = length
    return out


def fed_lengths(cache: Any, idx: int) -> set[int]:
    """What a live quantized layer says row ``idx`` holds (see ``rows.fed_lengths``)."""
    if type(cache) is BatchQuantizedKVCache:
        return {int(cache._idx) - int(cache.left_padding[idx].item()), int(cache.offset[idx].item())}
    if type(cache) is QuantizedKVCache and idx == 0:
        return {int(cache.offset)}
    return set()


def fresh(quant: KVQuant) -> QuantizedKVCache:
    """An empty layer as a cold prefill under ``--kv-bits`` starts it (the canary's cold side)."""
    return QuantizedKVCache(group_size=quant.group_size, bits=quant.bits)


def refuse_layer(index: int, cache: Any) -> UnsupportedCacheError:
    """A layer ``--kv-bits`` would quantize in a way the codec does not model."""
    return UnsupportedCacheError(
        f"the lineage cache cannot restore layer {index} ({type(cache).__name__}) under --kv-bits: "
        "mlx-vlm quantizes its KV children inside a composite or chunked layer, which has no "
        "restore rule. Run without --kv-bits, or with APC_LINEAGE=0 for stock mlx-vlm's prompt cache")


__all__ = ["KEY_PARTS", "PARTS", "PackedCodec", "ROW_AXIS", "VALUE_PARTS", "codec_name", "fed_lengths",
           "fresh", "is_packed", "quantized_layers", "refuse_layer", "row"]
