"""A model's cache layout, and the two handles the policy stores: KV rows and snapshots.

``CacheLayout.from_model`` classifies every layer (and every ``CacheList`` child) once at
startup. ``split`` turns live per-row caches into references; ``build`` makes fresh cache
objects at a restore length whose KV are views truncated to that length. Nothing is copied:
evaluated MLX arrays are immutable and a slice update copies when another reference exists,
so holding references never lets a later write change a stored state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import mlx.core as mx

from server_patch.state import quantized
from server_patch.state.options import KVQuant
from server_patch.state.row_view import live_view
from server_patch.state.registry import (DERIVED, Arrays, Codec, codec_for, is_composite, packed_codec,
                                         ref)


@dataclass(frozen=True)
class LayerLayout:
    codecs: tuple[Codec, ...]
    composite: bool


def _nbytes(arrays: Arrays) -> int:
    return sum(int(v.nbytes) for v in arrays.values() if isinstance(v, mx.array))


_ROW_AXIS = {"keys": 2, "values": 2, "pooled": 1, **{part: quantized.ROW_AXIS for part in quantized.PARTS}}


def _kept_rows(key: str, child: Arrays, length: int) -> int:
    """Rows of ``child[key]`` that belong to the first ``length`` tokens."""
    return length // int(child["ratio"]) if key == "pooled" else length


def _row_arrays(child: Arrays) -> list[tuple[str, mx.array]]:
    return [(k, v) for k, v in child.items() if isinstance(v, mx.array)]


def _head_rows(key: str, child: Arrays, value: mx.array, length: int) -> mx.array:
    """A view of the rows of ``value`` (``child[key]``) that belong to the first ``length`` tokens."""
    index = [slice(None)] * value.ndim
    index[_ROW_AXIS[key]] = slice(0, _kept_rows(key, child, length))
    return value[tuple(index)]


def _map_rows(layers: list[list[Arrays]], fn: Any) -> list[list[Arrays]]:
    """A copy of ``layers`` with ``fn(key, child, value)`` in place of every row array."""
    return [[{**child, **{k: fn(k, child, v) for k, v in _row_arrays(child)}} for child in layer]
            for layer in layers]


def _layer_arrays(layers: list[list[Arrays]]) -> list[mx.array]:
    return [v for layer in layers for child in layer for v in child.values() if isinstance(v, mx.array)]


@dataclass
class MlxKV:
    """KV handle: per layer, per child, the append-only arrays.

    An array may hold more rows than ``length`` (an adopted request buffer keeps its spare
    capacity, so a later turn can be lent the buffer and write past ``length`` in place);
    rows past ``length`` are not part of the state. While the buffer is lent (``lend``) the
    handle holds no arrays at all: a held reference would turn the borrower's in-place
    writes into copies.
    """

    layers: list[list[Arrays]]
    length: int
    lent: bool = False
    _lent_nbytes: int = 0
    _lent_held: int = 0
    _lent_keys: list[list[frozenset[str]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        """Bytes of the used rows only, not of the buffers behind the views."""
        if self.lent:
            return self._lent_nbytes
        total = 0
        for layer in self.layers:
            for child in layer:
                for key, value in _row_arrays(child):
                    rows = int(value.shape[_ROW_AXIS[key]])
                    if rows:
                        total += int(value.nbytes) // rows * min(rows, _kept_rows(key, child, self.length))
        return total

    def prefix(self, length: int) -> "MlxKV":
        """An independent copy of rows [:length], so an anchor outlives its lineage's buffers."""
        # mx.array copies; mx.contiguous would return a contiguous view as is, and the anchor
        # would keep the whole conversation buffer alive.
        result = MlxKV(_map_rows(self.layers, lambda k, c, v: mx.array(_head_rows(k, c, v, length))), length)
        mx.eval(result.arrays())
        return result

    def truncated(self, length: int) -> "MlxKV":
        """The same buffers holding only rows [:length] (no copy): rows past it are spare room
        again, as an adopted buffer's decode rows are."""
        if self.lent or length > self.length:
            raise ValueError("cannot truncate lent rows, or past the rows held")
        return MlxKV(self.layers, length)

    @property
    def held_nbytes(self) -> int:
        """Bytes of the buffers behind the rows, spare rows included: what holding them costs
        (an adopted buffer carries the reply and the room left for later turns)."""
        if self.lent:
            return self._lent_held
        return sum(int(v.nbytes) for v in self.arrays())

    def arrays(self) -> list[mx.array]:
        return [v for layer in self.layers for child in layer for _, v in _row_arrays(child)]

    def capacity(self, key: str = "keys") -> int:
        """Rows every ``key`` array can hold (0 if there is none): the lendable room."""
        rows = [int(child[key].shape[_ROW_AXIS[key]]) for layer in self.layers for child in layer
                if isinstance(child.get(key), mx.array)]
        return min(rows) if rows else 0

    def trimmed_layers(self) -> list[list[Arrays]]:
        """The layers with every array cut to ``length`` rows (what a disk file holds)."""
        # Another thread (the disk writer) may call this while the generation thread lends or
        # takes back the rows: read the layers once, and trust them only if no loan began or
        # ended meanwhile (``lend`` raises the flag before it swaps, ``give_back`` after).
        layers = self.layers
        if self.lent or self.layers is not layers:
            raise RuntimeError("KV rows are lent to a running request")
        return _map_rows(layers, lambda k, c, v: _head_rows(k, c, v, self.length))

    def lend(self, keys: tuple[str, ...] = ("keys", "values")) -> list[list[Arrays]]:
        """Hand the ``keys`` arrays over and forget them; ``give_back`` ends the loan.

        Returned are fresh array objects over the same buffers, evaluated here (call on the
        thread that will write them). Other arrays (pooled windows) stay in the handle.
        """
        nbytes, held = self.nbytes, self.held_nbytes
        taken: list[list[Arrays]] = []
        kept: list[list[Arrays]] = []
        for layer in self.layers:
            taken_layer, kept_layer = [], []
            for child in layer:
                taken_layer.append({k: ref(v) for k, v in child.items()
                                    if k in keys and isinstance(v, mx.array)})
                kept_layer.append({k: v for k, v in child.items() if k not in keys})
            taken.append(taken_layer)
            kept.append(kept_layer)
        mx.eval(_layer_arrays(taken))
        self._lent_keys = [[frozenset(child) for child in layer] for layer in taken]
        self._lent_nbytes, self._lent_held, self.lent = nbytes, held, True
        self.layers = kept  # after the flag: a reader holds the old lists or sees the loan
        return taken

    def give_back(self, taken: list[list[Arrays]]) -> None:
        """End a loan: ``taken`` (same structure ``lend`` returned) joins the kept arrays."""
        if not self.lent:
            raise RuntimeError("these KV rows are not lent")
        if [[frozenset(child) for child in layer] for layer in taken] != self._lent_keys:
            raise ValueError("the returned KV rows do not match what was lent")
        merged = [[{**kept, **back} for kept, back in zip(kept_layer, back_layer)]
                  for kept_layer, back_layer in zip(self.layers, taken)]
        mx.eval(_layer_arrays(taken))
        self.layers = merged  # before the flag: see ``trimmed_layers``
        self.lent, self._lent_nbytes, self._lent_held, self._lent_keys = False, 0, 0, []


@dataclass
class MlxSnapshot:
    """Snapshot handle: per layer, per child, the snapshot arrays (references) at ``length``."""

    layers: list[list[Arrays]]
    length: int

    @property
    def nbytes(self) -> int:
        return sum(_nbytes(child) for layer in self.layers for child in layer)

    def arrays(self) -> list[mx.array]:
        return _layer_arrays(self.layers)


class CacheLayout:
    """The per-layer codecs of one model's prompt cache."""

    def __init__(self, layers: Sequence[LayerLayout]) -> None:
        self.layers = tuple(layers)

    @classmethod
    def from_model(cls, language_model: Any, kv_quant: KVQuant | None = None) -> "CacheLayout":
        """Classify ``language_model.make_cache()``; unknown classes raise at startup.

        ``kv_quant`` (the server's ``--kv-bits``): the plain ``KVCache`` layers mlx-vlm
        quantizes get the packed codec (``state.quantized``); a composite or chunked layer
        with KV it would quantize is refused."""
        caches = language_model.make_cache()
        derived = derived_children(language_model)
        packed = quantized.quantized_layers(len(caches)) if kv_quant is not None else [False] * len(caches)
        layers = []
        for i, cache in enumerate(caches):
            if is_composite(cache):
                codecs = tuple(DERIVED if j in derived.get(i, ()) else codec_for(child)
                               for j, child in enumerate(cache.caches))
                if kv_quant is not None and any(c.name in ("kv", "chunked") for c in codecs):
                    raise quantized.refuse_layer(i, cache)
                layers.append(LayerLayout(codecs, True))
            else:
                codec = codec_for(cache)
                if kv_quant is not None and codec.name == "chunked":
                    raise quantized.refuse_layer(i, cache)
                if packed[i] and codec.name == "kv":
                    codec = packed_codec(kv_quant)
                layers.append(LayerLayout((codec,), False))
        return cls(layers)

    @property
    def kv_quant_label(self) -> str:
        """The packed codec's name (``qkv8g64``), or "" for float KV: a disk directory of one
        never holds the other's files (a layout mismatch would remove them)."""
        return next((c.name for layer in self.layers for c in layer.codecs if quantized.is_packed(c.name)), "")

    @property
    def packed(self) -> bool:
        """Some layer holds quantized KV (``--kv-bits``): buffers are never lent or adopted."""
        return any(quantized.is_packed(c.name) for layer in self.layers for c in layer.codecs)

    def fresh(self, language_model: Any) -> list[Any]:
        """Empty caches as a cold prefill under this layout starts (quantized where packed)."""
        caches = list(language_model.make_cache())
        for i, layer in enumerate(self.layers):
            codec = layer.codecs[0]
            if not layer.composite and quantized.is_packed(codec.name):
                caches[i] = codec.build({}, {}, 0)
        return caches

    def describe(self) -> str:
        """A short string that two processes agree on iff their layouts match (disk headers)."""
        parts = []
        for layer in self.layers:
            names = ",".join(c.name for c in layer.codecs)
            parts.append(f"[{names}]" if layer.composite else names)
        return ";".join(parts)

    def _children(self, caches: Sequence[Any]) -> list[list[tuple[Codec, Any]]]:
        if len(caches) != len(self.layers):
            raise ValueError(f"cache has {len(caches)} layers, layout has {len(self.layers)}")
        out = []
        for layer, cache in zip(self.layers, caches):
            children = list(cache.caches) if layer.composite else [cache]
            if len(children) != len(layer.codecs):
                raise ValueError("cache layer does not match the layout")
            out.append(list(zip(layer.codecs, children)))
        return out

    def split(self, caches: Sequence[Any], length: int) -> tuple[MlxKV, MlxSnapshot]:
        """References to ``caches`` (one row, ``length`` tokens) as (KV rows, snapshot)."""
        rows, snaps = [], []
        for layer in self._children(caches):
            layer_rows, layer_snaps = [], []
            for codec, child in layer:
                r, s = codec.split(child)
                layer_rows.append(r)
                layer_snaps.append(s)
            rows.append(layer_rows)
            snaps.append(layer_snaps)
        kv, snapshot = MlxKV(rows, length), MlxSnapshot(snaps, length)
        # Views are graph nodes on the caller's stream; evaluate them here, on the thread that
        # built them, so the disk writer, the idle ticker and /admin/flush (other threads) only
        # ever read memory. Evaluating a slice copies nothing.
        mx.eval(kv.arrays(), snapshot.arrays())
        return kv, snapshot

    def snapshot(self, caches: Sequence[Any], length: int) -> MlxSnapshot:
        """Only the snapshot part: what a checkpoint holds (its KV rows are the entry's)."""
        return self.split(caches, length)[1]

    def build(self, kv: MlxKV, snapshot: MlxSnapshot, length: int) -> list[Any]:
        """Fresh cache objects at ``length``: KV views truncated, snapshots by reference.

        Raises while ``kv`` is lent (``MlxKV.lend``): the handle then holds no KV rows, and a
        cache built from it would pair an empty attention cache with a recurrent state at
        ``length``. The caller falls back to a cold prefill; the lease sweep gives the rows
        back before any restore that needs them."""
        if kv.lent:
            raise RuntimeError("KV rows are lent to a running request: nothing to build from")
        return self._build(kv, snapshot, length)

    def _build(self, kv: MlxKV, snapshot: MlxSnapshot, length: int) -> list[Any]:
        if snapshot.length != length:
            raise ValueError(f"snapshot is at {snapshot.length} tokens, restore wants {length}")
        if length > kv.length:
            raise ValueError(f"KV rows hold {kv.length} tokens, restore wants {length}")
        caches = []
        for layer, rows, snaps in zip(self.layers, kv.layers, snapshot.layers):
            built = [codec.build(r, s, length) for codec, r, s in zip(layer.codecs, rows, snaps)]
            if layer.composite:
                from mlx_vlm.models.cache import CacheList

                caches.append(CacheList(*built))
            else:
                caches.append(built[0])
        return caches

    def build_lent(self, kv: MlxKV, lent: list[list[Arrays]], snapshot: MlxSnapshot,
                   length: int) -> list[Any]:
        """Like ``build``, but every KV child gets the lent buffers themselves (``MlxKV.lend``),
        spare rows included, so the request appends at ``length`` in place. ``lent`` is
        consumed: the caches are then the buffers' only holders."""
        if not kv.lent or length != kv.length:
            raise ValueError("a lent build restores a lent entry at its own length")
        if any(int(child["keys"].shape[2]) < length for layer in lent for child in layer if "keys" in child):
            raise ValueError("a lent buffer is shorter than its entry")
        caches = self._build(kv, snapshot, length)  # the KV children are filled in below
        for cache, layer, taken_layer in zip(caches, self.layers, lent):
            children = list(cache.caches) if layer.composite else [cache]
            for codec, child, taken in zip(layer.codecs, children, taken_layer):
                if codec.name == "kv" and "keys" in taken:
                    child.keys, child.values = taken.pop("keys"), taken.pop("values")
                    child.offset = length
        return caches

    def lent_rows(self, caches: Sequence[Any], length: int) -> list[list[Arrays]]:
        """The inverse of ``build_lent``: references to the KV buffers one-row ``caches`` hold
        now (restored ``KVCache`` rows, or the lone row of a ``BatchKVCache``), in the shape
        ``MlxKV.give_back`` takes. Raises if a buffer no longer holds ``length`` rows at row 0."""
        out = []
        for layer in self._children(caches):
            out_layer: list[Arrays] = []
            for codec, child in layer:
                keys = getattr(child, "keys", None) if codec.name == "kv" else None
                if keys is None:
                    out_layer.append({})
                    continue
                padding = getattr(child, "left_padding", None)
                if int(keys.shape[0]) != 1 or int(keys.shape[2]) < length or \
                        (padding is not None and int(padding[0].item()) != 0) or live_view(child) is not None:
                    raise ValueError("the lent buffer's rows moved (batch shape changed)")
                out_layer.append({"keys": ref(keys), "values": ref(child.values)})
            out.append(out_layer)
        return out


def derived_children(language_model: Any) -> dict[int, set[int]]:
    """Cache children that are a function of other children and must never be stored.

    glm5_next's attention ``CacheList`` keeps a projected per-head K/V cache (~64x the latent);
    it is the last child: index 3 with its own indexer, index 1 on shared-indexer layers.
    """
    if "glm5_next" not in type(language_model).__module__:
        return {}
    layers = getattr(language_model, "layers", None)
    if layers is None:
        layers = language_model.model.layers
    derived: dict[int, set[int]] = {}
    for i, layer in enumerate(layers):
        if getattr(layer, "block_type", "") == "linear_attention":
            continue
        derived[i] = {1 if layer.self_attn.indexer is None else 3}
    return derived
